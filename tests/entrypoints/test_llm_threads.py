"""Two LLMs whose cores run in this process (KILN_ENABLE_V1_MULTIPROCESSING=0) driven from two
threads at once: each gets the outputs it gets alone (their forwards share the process-wide
forward context, so they take turns)."""
import threading

from kiln.entrypoints.llm import LLM
from kiln.sampling_params import SamplingParams

ENGINE = dict(enforce_eager=True, max_model_len=64, max_num_seqs=4, kv_cache_memory=0.02)
PROMPTS = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(4)]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_two_inprocess_llms_in_two_threads(tiny_llama_dir, inprocess_core):
    """The second thread's step failed with "set_forward_context() is not re-entrant" (or, in
    the window between the first's check and its set, replaced the first's context)."""
    llms = [LLM(model=str(tiny_llama_dir), **ENGINE) for _ in range(2)]
    try:
        def tokens(llm):
            return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]

        alone = tokens(llms[0])
        for _ in range(3):
            got, errors = {}, []

            def run(i, got=got, errors=errors):
                try:
                    got[i] = tokens(llms[i])
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not errors and got == {0: alone, 1: alone}
    finally:
        for llm in llms:
            llm.shutdown()
