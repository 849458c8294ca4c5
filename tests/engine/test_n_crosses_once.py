"""An n > 1 request crosses to the core process in one message, its params once (a whole-
vocabulary logit_bias at n=128 sent per sample held the core for seconds), and still runs as
n samples: seeded per sample, merged into one output, aborted together."""
import pytest

from kiln.core.core_messages import EngineCoreRequest
from kiln.entrypoints.llm import LLM
from kiln.sampling_params import SamplingParams

ENGINE = dict(enforce_eager=True, max_model_len=64, kv_cache_memory=0.01)
PROMPT = {"prompt_token_ids": [1, 2, 3, 4]}


# mp_llm: tests/engine/conftest.py's (ENGINE's settings, its core in a process of its own).


@pytest.fixture
def sent(mp_llm, monkeypatch):
    """Every message the front end sends the core."""
    client = mp_llm.llm_engine.engine_core
    messages = []
    send = client._send

    def recording_send(message):
        messages.append(message)
        send(message)

    monkeypatch.setattr(client, "_send", recording_send)
    return messages


def test_an_n_request_is_one_message_to_the_core(mp_llm, sent):
    vocab = mp_llm.llm_engine.model_config.vocab_size
    params = SamplingParams(n=6, temperature=1.0, seed=11, max_tokens=4, ignore_eos=True,
                            logit_bias={t: 0.25 for t in range(vocab)})
    [out] = mp_llm.generate([PROMPT], params, use_tqdm=False)
    adds = [m for m in sent if isinstance(m, EngineCoreRequest)]
    assert len(adds) == 1
    assert adds[0].sampling_params["n"] == 6 and len(adds[0].sampling_params["logit_bias"]) == vocab
    assert adds[0].child_ids == [f"{i}_{out.request_id}" for i in range(6)]
    assert [c.index for c in out.outputs] == list(range(6))
    assert all(len(c.token_ids) == 4 and c.finish_reason == "length" for c in out.outputs)


def test_each_sample_keeps_its_own_seed(mp_llm):
    """Sample i of a seeded n request samples as an n=1 request seeded seed + i (vLLM's)."""
    greedy_free = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    [together] = mp_llm.generate([PROMPT], SamplingParams(n=3, seed=5, **greedy_free),
                                 use_tqdm=False)
    alone = mp_llm.generate([PROMPT] * 3, [SamplingParams(seed=5 + i, **greedy_free)
                                           for i in range(3)], use_tqdm=False)
    assert [c.token_ids for c in together.outputs] == [o.outputs[0].token_ids for o in alone]
    assert len({tuple(c.token_ids) for c in together.outputs}) > 1  # the seeds differ


def test_aborting_the_parent_ends_every_sample_in_the_core(mp_llm):
    engine = mp_llm.llm_engine
    engine.add_request("p", PROMPT, SamplingParams(n=4, max_tokens=50, ignore_eos=True,
                                                   temperature=1.0))
    engine.step()
    engine.abort_request("p")
    assert not engine.has_unfinished_requests()
    stats = engine.engine_core.make_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_an_in_process_core_makes_the_same_samples(mp_llm, tiny_llama_dir, monkeypatch):
    params = SamplingParams(n=3, seed=9, temperature=1.0, max_tokens=5, ignore_eos=True,
                            logit_bias={7: 3.0})
    [there] = mp_llm.generate([PROMPT], params, use_tqdm=False)
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")
    here = LLM(model=str(tiny_llama_dir), **ENGINE)
    try:
        [local] = here.generate([PROMPT], params, use_tqdm=False)
    finally:
        here.shutdown()
    assert [c.token_ids for c in local.outputs] == [c.token_ids for c in there.outputs]
