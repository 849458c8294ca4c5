"""EAGLE-1 speculative decoding (vLLM's method='eagle') on tiny random checkpoints: a random head
drafts exactly what EAGLE's equations give from HF's target hidden states (eagle_heads.py's
torch reference) and never changes greedy output; a head mirroring a 1-layer target whose next
token depends on the last token alone has every draft accepted, eagerly and compiled (the head
traced once, then loaded from the compile cache by a second engine); heads
that do not fit the target are refused at config time."""
import pytest

from kiln import SamplingParams
from kiln.config.speculative_config import SpeculativeConfig
from kiln.errors import ConfigError

from .eagle_heads import make_bigram_target, reference_drafts, write_head
from .test_draft_model import all_accepted, assert_same
from .test_spec_decode_e2e import PROMPTS, generate, make, spec_totals


def eagle_spec(head_dir, k=3) -> dict:
    return {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def random_head(tmp_path_factory, tiny_llama_dir):
    return write_head(tmp_path_factory.mktemp("eagle") / "head", tiny_llama_dir)


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    """(target, its mirroring head)."""
    root = tmp_path_factory.mktemp("bigram")
    target = make_bigram_target(root / "target")
    return target, write_head(root / "head", target, mirror=True)


def record_proposals(llm) -> list:
    """Each proposal the runner's EAGLE head makes: (the request's known tokens, drafts)."""
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    seen, propose = [], runner.drafter.propose

    def recording(r, so, req_ids, sample_req_ids, hidden=None):
        out = propose(r, so, req_ids, sample_req_ids, hidden)
        for req_id, drafts in out.items():
            state = r.requests[req_id]
            seen.append(([*state.prompt_token_ids, *state.output_token_ids], drafts))
        return out
    runner.drafter.propose = recording
    return seen


def test_random_head_drafts_eagles_tokens_and_keeps_greedy_output(
        inprocess_core, tiny_llama_dir, random_head):
    llm, base = make(tiny_llama_dir, eagle_spec(random_head)), make(tiny_llama_dir, None)
    seen = record_proposals(llm)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    before = spec_totals(llm)
    assert_same(generate(llm, PROMPTS, params), generate(base, PROMPTS, params), logprobs=True)
    after = spec_totals(llm)
    assert after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"] >= 3 * 4
    assert len(after["spec_decode_num_accepted_tokens_per_pos"]) == 3
    # after the prefill, after decodes and after rejected drafts: the head's K/V caught up on
    # the accepted positions only, and read the target's hidden state of each
    for tokens, drafts in seen[::4]:
        assert drafts == reference_drafts(random_head, tiny_llama_dir, tokens, len(drafts))
    # a prompt hitting the blocks another cached, then going on otherwise: the head's K/V at
    # the hit's last position read the other prompt's next token, so it is computed again
    shared = list(range(100, 140))
    generate(llm, [shared], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    hits = llm.llm_engine.get_stats()["prefix_cache_hits"]
    seen.clear()
    generate(llm, [shared[:32] + [7, 8, 9, 10]],
             SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for tokens, drafts in seen:
        assert drafts == reference_drafts(random_head, tiny_llama_dir, tokens, len(drafts))
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] - hits == 16  # 2 blocks, less 1


def test_mirroring_head_has_every_draft_accepted_eager_and_compiled(inprocess_core, bigram,
                                                                     tmp_path):
    from kiln.compilation.counters import compilation_counter as c

    from checkpoints import hf_greedy

    target, head = bigram
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = hf_greedy(target, PROMPTS, 20)
    # mode 0 with a small budget: chunked prefills beside drafted decodes, each chunk's
    # positions reading the next prompt token; mode 3: the target and the head compiled
    # (each traced once, split at its 1 attention layer: 3 pieces, 2 compiled), then a
    # second engine on the same cache runs both saved graphs (no trace)
    cache = {"cache_dir": str(tmp_path / "cc")}
    for mode, kwargs, counts in (
            (0, {"max_num_batched_tokens": 8, "max_num_seqs": 3}, {"num_dynamo_traces": 0}),
            (3, {}, {"num_dynamo_traces": 2, "num_piecewise_graphs_seen": 6,
                     "num_piecewise_capturable_graphs_seen": 4}),
            (3, {}, {"num_dynamo_traces": 0, "num_saved_graph_loads": 2})):
        with c.expect(**counts):
            llm = make(target, eagle_spec(head, k=4), mode=mode, compilation=cache, **kwargs)
        assert llm.llm_engine.kiln_config.compilation_config.mode == mode
        drafter = llm.llm_engine.engine_core.executor.worker.model_runner.drafter
        assert drafter.compiles == (mode == 3)
        before = spec_totals(llm)
        with c.expect(num_dynamo_traces=0, num_backend_compilations=0):  # none while serving
            assert [list(o.token_ids) for o in generate(llm, PROMPTS, params)] == want
        assert all_accepted(llm, before) >= 3 * 4 * 3
        del llm


def test_method_names_and_refusals(tiny_llama_dir, random_head, tmp_path):
    from kiln.engine.arg_utils import EngineArgs

    def kiln_config(spec, **kwargs):
        return EngineArgs(model=str(tiny_llama_dir), speculative_config=spec,
                          load_format="dummy", **kwargs).create_kiln_config()

    config = kiln_config(eagle_spec(random_head)).speculative_config
    assert config.draft_model_config.architecture == "EagleLlamaForCausalLM"
    assert config.to_dict() == eagle_spec(random_head)
    # vLLM infers the method from the head's name
    assert SpeculativeConfig(model="yuhuili/EAGLE-LLaMA3-Instruct-8B",
                             num_speculative_tokens=2).method == "eagle"
    for method in ("mtp", "medusa"):
        with pytest.raises(ConfigError, match=f"method='{method}' is not supported") as e:
            SpeculativeConfig(method=method, model="x", num_speculative_tokens=2)
        assert "'eagle'" in str(e.value)
    with pytest.raises(ConfigError, match="method='eagle' needs speculative_config.model"):
        SpeculativeConfig(method="eagle", num_speculative_tokens=2)
    bad = {"hidden_size=32": write_head(tmp_path / "h", tiny_llama_dir, hidden_size=32),
           "vocab_size=600": write_head(tmp_path / "v", tiny_llama_dir, vocab_size=600),
           "not an EAGLE-1 Llama head": write_head(tmp_path / "a", tiny_llama_dir,
                                                   architecture="Eagle3LlamaForCausalLM"),
           "a HASS head": write_head(tmp_path / "n", tiny_llama_dir, add_para_norm=True)}
    for message, head in bad.items():
        with pytest.raises(ConfigError, match="--speculative-config") as e:
            kiln_config(eagle_spec(head))
        assert message in str(e.value), str(e.value)
    from types import SimpleNamespace

    from kiln.config.eagle_config import eagle_model_config
    with pytest.raises(ConfigError, match="the target is GemmaForCausalLM"):
        eagle_model_config(config, SimpleNamespace(architecture="GemmaForCausalLM"))
    # the head compiles with a mode-3 target unless the draft's enforce_eager says not
    from kiln.spec_decode.draft_model_proposer import draft_compiles
    for mode, eager, compiles in ((3, None, True), (3, True, False), (0, None, False)):
        assert draft_compiles(kiln_config({**eagle_spec(random_head), "enforce_eager": eager},
                                          compilation_config={"mode": mode})) == compiles
    # the head is sharded over the target's ranks (tests/distributed/test_tp_spec_decode.py)
    assert kiln_config(eagle_spec(random_head), tensor_parallel_size=2).speculative_config
    with pytest.raises(ConfigError, match="draft_tensor_parallel_size=1 differs from "
                                          "--tensor-parallel-size 2"):
        kiln_config({**eagle_spec(random_head), "draft_tensor_parallel_size": 1},
                    tensor_parallel_size=2)
    # a head is no model to serve
    with pytest.raises(ConfigError, match="an EAGLE draft head, not a model"):
        EngineArgs(model=str(random_head), load_format="dummy").create_kiln_config()


def test_a_head_shorter_than_max_model_len_drafts_for_shorter_requests(inprocess_core, bigram,
                                                                       tmp_path):
    """A head whose max_position_embeddings (24) is below --max-model-len was refused (its
    config took the target's length); as a draft model it is capped at its own, the tokens
    unchanged and no draft made past it (EAGLE-3 heads ship 2048 beside 128k targets). The
    head runs one position behind the tokens, so it drafts once more than a draft model would
    at its end: a 24-token prompt still gets a draft (from head position 23)."""
    from checkpoints import hf_greedy

    target, _ = bigram
    short = write_head(tmp_path / "short", target, mirror=True, max_position_embeddings=24)
    llm = make(target, eagle_spec(short, k=4), max_model_len=64)
    spec = llm.llm_engine.kiln_config.speculative_config
    assert spec.draft_model_config.max_model_len == 24
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # drafted up to its end (4, then 2 from positions 22 and 23); at its end; past it
    for length, drafted in ((18, 6), (24, 1), (25, 0)):
        prompt = list(range(3, 3 + length))
        before = spec_totals(llm)
        assert [list(o.token_ids) for o in generate(llm, [prompt], params)] == \
            hf_greedy(target, [prompt], 12)
        after = spec_totals(llm)
        assert after["spec_decode_num_draft_tokens"] - \
            before["spec_decode_num_draft_tokens"] == drafted
        assert after["spec_decode_num_accepted_tokens"] - \
            before["spec_decode_num_accepted_tokens"] == drafted


def test_a_model_given_as_a_head_is_refused_naming_the_flag(tiny_llama_dir):
    """A whole Llama given as method='eagle' (its config reads as a head's) failed to load
    naming a tensor and 'fix the config', not the flag that named the checkpoint."""
    import torch

    from kiln.engine.arg_utils import EngineArgs
    from kiln.spec_decode.eagle_proposer import EagleProposer

    config = EngineArgs(model=str(tiny_llama_dir), speculative_config=eagle_spec(tiny_llama_dir),
                        enforce_eager=True).create_kiln_config()
    with pytest.raises(ConfigError, match=r"^--speculative-config: speculative_config\.model="
                       r".*\(method='eagle'\): checkpoint tensor model\.layers\.0\."):
        EagleProposer(config, torch.device("cpu")).load()
