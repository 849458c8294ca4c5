"""allowed_token_ids, bad_words, logit_bias and truncate_prompt_tokens: the pure pieces, then
their effect on a tiny model's greedy tokens; cache_salt keeps prefix-cache hits apart."""
import pytest
import torch

from kiln.sample.logit_masks import BadWordIndex, apply_allowed_token_ids, apply_logit_bias
from kiln.sampling_params import SamplingParams

PROMPT = {"prompt_token_ids": [5, 17, 33, 64, 101, 7, 9, 250]}


def test_bad_word_bans_follow_the_output():
    words = [[7], [3, 4, 5], [9, 9]]
    assert BadWordIndex(words).bans([]) == [7]
    assert BadWordIndex(words).bans([1, 3, 4]) == [7, 5]
    assert BadWordIndex(words).bans([3, 4, 9]) == [7, 9]


def test_allowed_mask_and_bias_edit_only_their_rows():
    logits = torch.zeros(4, 5)
    allowed = torch.tensor([False, True, False, False, True])
    apply_allowed_token_ids(logits, torch.tensor([1, 3]), allowed)
    assert torch.isinf(logits[[1, 3]][:, [0, 2, 3]]).all() and (logits[[1, 3]][:, [1, 4]] == 0).all()
    assert (logits[[0, 2]] == 0).all()
    apply_logit_bias(logits, torch.tensor([0, 2]), torch.tensor([3, 1]), torch.tensor([1.0, -5.0]))
    assert logits[0].tolist() == [0, -5.0, 0, 1.0, 0] and logits[2].tolist() == [0, -5.0, 0, 1.0, 0]
    assert logits[1, 1] == 0 and logits[1, 4] == 0


def test_a_requests_edits_are_built_once_and_shared_by_its_steps():
    """allowed_token_ids, logit_bias and bad words become arrays at a request's first step and
    are reused (the whole vocabulary rebuilt in Python each step held every stream seconds);
    the step's tensors are as before."""
    from kiln.sample.sampling_metadata import build_sampling_metadata

    vocab = 50
    biased = SamplingParams(logit_bias={t: 1.0 for t in range(60)}, bad_words=["x"])
    biased.bad_words_token_ids = [[7], [3, 4]]
    allowed = SamplingParams(allowed_token_ids=[2, 5, 70])
    plain = SamplingParams()

    def step(outputs):
        return build_sampling_metadata([plain, biased, allowed], [[1]] * 3, outputs,
                                       [None] * 3, None, vocab, torch.device("cpu"))

    first = step([[], [9, 3], []])
    kept = biased.__dict__["_kiln_step_arrays"]
    second = step([[], [3, 4, 9], []])
    assert biased.__dict__["_kiln_step_arrays"] is kept
    for meta in (first, second):
        [bias] = meta.bias
        assert bias.rows.tolist() == [1] and bias.cols.tolist() == list(range(vocab))
        [allowed_group] = meta.allowed
        assert allowed_group.rows.tolist() == [2]
        assert allowed_group.mask.nonzero().flatten().tolist() == [2, 5]
    assert sorted(first.min_tokens_cols.tolist()) == [4, 7]  # the output ends in the 3 of 3 4
    assert second.min_tokens_cols.tolist() == [7]


def test_an_n_requests_samples_share_one_edit_group_and_one_build():
    """The samples of an n > 1 request (shallow copies sharing logit_bias, allowed_token_ids and
    bad words) are one group of rows over one [V] array, built once: per-row copies of a
    whole-vocabulary bias at n=128 joined 6M entries on every step, and each sample built its
    own arrays at its first."""
    from kiln.core.parent_request import child_params
    from kiln.sample.sampler import Sampler
    from kiln.sample.sampling_metadata import build_sampling_metadata

    vocab = 40
    parent = SamplingParams(n=3, temperature=0.0, logit_bias={t: float(t) for t in range(vocab)},
                            allowed_token_ids=list(range(0, vocab, 2)), bad_words=["x"])
    parent.bad_words_token_ids = [[5]]
    other = SamplingParams(temperature=0.0, logit_bias={3: 100.0})
    params = [child_params(parent, i) for i in range(3)] + [other]
    meta = build_sampling_metadata(params, [[1]] * 4, [[]] * 4, [None] * 4, None, vocab,
                                   torch.device("cpu"))
    assert [g.rows.tolist() for g in meta.bias] == [[0, 1, 2], [3]]
    assert [g.rows.tolist() for g in meta.allowed] == [[0, 1, 2]]
    built = {id(p.__dict__["_kiln_step_arrays"]) for p in params[:3]}
    assert len(built) == 1  # one build for the three samples
    logits = torch.zeros(4, vocab)
    out = Sampler()(logits, meta)
    # greedy: each sample takes its largest even token that is not banned; the other row its bias
    assert out.sampled_token_ids.flatten().tolist() == [38, 38, 38, 3]


@pytest.mark.parametrize("seed", range(40))
def test_a_mixed_batchs_edits_are_each_rows_own(seed):
    """Rows grouped by the identity of their settings (n > 1 samples), rows of other requests
    with equal but separate settings, and rows with none, beside bad words, min_tokens and
    penalties: each row samples what it samples alone, in any order of the batch."""
    import copy
    import random

    from kiln.core.parent_request import child_params
    from kiln.sample.sampler import Sampler
    from kiln.sample.sampling_metadata import build_sampling_metadata

    rng, vocab, cpu = random.Random(seed), 48, torch.device("cpu")
    biases = [{rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(8)} for _ in range(2)]
    allowed = [rng.sample(range(vocab), 12) for _ in range(2)]
    rows = []  # (params, output token ids)
    for _ in range(rng.randrange(1, 6)):
        kw = dict(n=rng.choice([1, 2, 4]), temperature=0.0, min_tokens=rng.choice([0, 3]),
                  repetition_penalty=rng.choice([1.0, 1.5]))
        if rng.random() < 0.6:
            kw["logit_bias"] = dict(rng.choice(biases))  # equal to another's, not the same
        if rng.random() < 0.6:
            kw["allowed_token_ids"] = list(rng.choice(allowed))
        parent = SamplingParams(**kw)
        parent.update_from_tokenizer(2, vocab)
        if rng.random() < 0.4:
            parent.bad_words_token_ids = [[rng.randrange(vocab)], [7, rng.randrange(vocab)]]
        for i in range(parent.n):
            rows.append((child_params(parent, i) if parent.n > 1 else parent,
                         [rng.choice([7, rng.randrange(vocab)]) for _ in range(rng.randrange(3))]))
    rng.shuffle(rows)
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed))

    def sample(batch, logits):
        meta = build_sampling_metadata([p for p, _ in batch], [[1, 7]] * len(batch),
                                       [o for _, o in batch], [None] * len(batch), None, vocab, cpu)
        return Sampler()(logits, meta).sampled_token_ids.flatten().tolist()

    def fresh(p):  # its own copy, its arrays built anew
        p = copy.deepcopy(p)
        p.__dict__.pop("_kiln_step_arrays", None)
        return p

    together = sample(rows, logits)
    alone = [sample([(fresh(p), o)], logits[i:i + 1])[0] for i, (p, o) in enumerate(rows)]
    assert together == alone
    order = list(range(len(rows)))[::-1]  # a later step, its arrays kept on the params
    assert sample([rows[i] for i in order], logits[order]) == [together[i] for i in order]


def test_validation_names_the_field_and_vocab_bound():
    from kiln.engine.prompt_length import truncate_prompt

    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"5": 1.0})
    p = SamplingParams(allowed_token_ids=[3, 600])
    with pytest.raises(ValueError, match="allowed_token_ids contains 600"):
        p.update_from_tokenizer(2, 512)
    assert truncate_prompt([1, 2, 3, 4], 2, 10) == [3, 4]
    assert truncate_prompt([1, 2, 3, 4], -1, 3) == [3, 4]  # room for one token to generate
    assert truncate_prompt([1, 2, 3, 4], None, 3) == [1, 2, 3, 4]
    # a text prompt's BOS stays (HF's left truncation, as vLLM tokenizes)
    assert truncate_prompt([1, 2, 3, 4, 5], 3, 10, head=1) == [1, 4, 5]
    assert truncate_prompt([1, 2, 3], 3, 10, head=1) == [1, 2, 3]
    assert truncate_prompt([1, 2, 3], 1, 10, head=1) == [1]  # HF (vLLM) keeps only the BOS


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    from kiln import LLM

    llm = LLM(model=str(tiny_llama_dir), enforce_eager=True, max_model_len=64, block_size=4)
    yield llm
    llm.shutdown()


def greedy(llm, prompt=PROMPT, **kw):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **kw)
    return llm.generate(prompt, params, use_tqdm=False)[0]


def test_token_fields_change_greedy_tokens(llm):
    base = greedy(llm).outputs[0].token_ids
    assert set(greedy(llm, allowed_token_ids=[11, 12]).outputs[0].token_ids) <= {11, 12}
    assert greedy(llm, logit_bias={42: 100.0}).outputs[0].token_ids == [42] * 6
    # Banning the first greedy token's word: it never comes, the rest may change.
    word = llm.get_tokenizer().decode([base[0]])
    banned = greedy(llm, bad_words=[word]).outputs[0].token_ids
    assert base[0] not in banned
    # Penalties and edits together: the penalty does not undo the bias.
    assert greedy(llm, logit_bias={42: 100.0}, repetition_penalty=1.5).outputs[0].token_ids == \
        [42] * 6
    out = greedy(llm, truncate_prompt_tokens=3)
    assert out.prompt_token_ids == PROMPT["prompt_token_ids"][-3:]
    assert out.outputs[0].token_ids == greedy(
        llm, {"prompt_token_ids": PROMPT["prompt_token_ids"][-3:]}).outputs[0].token_ids


def test_cache_salt_separates_prefix_cache_hits(llm):
    llm.reset_prefix_cache()
    ids = list(range(20, 36))
    assert greedy(llm, {"prompt_token_ids": ids}).num_cached_tokens == 0
    assert greedy(llm, {"prompt_token_ids": ids}).num_cached_tokens > 0
    salted = {"prompt_token_ids": ids, "cache_salt": "tenant-a"}
    assert greedy(llm, salted).num_cached_tokens == 0
    assert greedy(llm, salted).num_cached_tokens > 0
    with pytest.raises(ValueError, match="cache_salt"):
        greedy(llm, {"prompt_token_ids": ids, "cache_salt": ""})
