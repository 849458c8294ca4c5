"""EAGLE-3 speculative decoding (vLLM's method='eagle3') on a tiny random Llama: random heads draft
exactly what EAGLE-3's equations give from HF's hidden states of the head's 3 target layers
(eagle3_heads.py's torch reference) and never change greedy output, eagerly and with the target
compiled (mode 3: the piecewise graph outputs the layers' states); heads that do not fit the
target are refused at config or load time."""
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file, save_file

from kiln import SamplingParams
from kiln.config.speculative_config import SpeculativeConfig
from kiln.errors import ConfigError

from .eagle3_heads import reference_eagle3_drafts, write_eagle3_head
from .eagle_heads import write_head
from .test_draft_model import assert_same
from .test_eagle import record_proposals
from .test_spec_decode_e2e import PROMPTS, generate, make, spec_totals


def eagle3_spec(head_dir, k=3) -> dict:
    return {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def heads(tmp_path_factory, tiny_llama_dir):
    """yuhuili's layout with a draft vocabulary (own lm_head, d2t; the target's embedding), and
    model.layers.0.* with the target's vocabulary (own embedding; the target's LM head, no
    d2t), whose residual is taken after hidden_norm; and one 96 wide over the 64-wide target
    (vLLM's target_hidden_size), its own embedding and LM head."""
    root = tmp_path_factory.mktemp("eagle3")
    return (write_eagle3_head(root / "draft_vocab", tiny_llama_dir, draft_vocab=200),
            write_eagle3_head(root / "full_vocab", tiny_llama_dir, seed=1, yuhuili=False,
                              own_embed=True, own_lm_head=False, d2t=False,
                              norm_before_residual=True, aux_ids=[1, 0, 2]),
            write_eagle3_head(root / "wide", tiny_llama_dir, seed=2, draft_vocab=300,
                              own_embed=True, width=96))


def test_random_heads_draft_eagle3s_tokens_and_keep_greedy_output(
        inprocess_core, tiny_llama_dir, heads):
    base = make(tiny_llama_dir, None)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    want = generate(base, PROMPTS, params)
    for mode, head in ((0, heads[0]), (3, heads[1]), (3, heads[2])):
        llm = make(tiny_llama_dir, eagle3_spec(head), mode=mode)
        assert llm.llm_engine.kiln_config.compilation_config.mode == mode
        seen = record_proposals(llm)
        before = spec_totals(llm)
        assert_same(generate(llm, PROMPTS, params), want, logprobs=True)
        after = spec_totals(llm)
        assert after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"] >= 3 * 4
        # after the prefill, after decodes and after rejected drafts: the head read the
        # target's states of the 3 layers at each accepted position
        for tokens, drafts in seen[::4]:
            assert drafts == reference_eagle3_drafts(head, tiny_llama_dir, tokens, len(drafts))
        del llm


def test_refusals(tiny_llama_dir, heads, tmp_path):
    from kiln.engine.arg_utils import EngineArgs

    def kiln_config(spec, **kwargs):
        return EngineArgs(model=str(tiny_llama_dir), speculative_config=spec,
                          load_format="dummy", **kwargs).create_kiln_config()

    config = kiln_config(eagle3_spec(heads[0]))
    assert config.speculative_config.draft_model_config.architecture == "Eagle3LlamaForCausalLM"
    assert config.speculative_config.to_dict() == eagle3_spec(heads[0])
    # the compiled target outputs the aux states: not the graph cached without them
    assert config.compute_hash() != kiln_config(None).compute_hash()
    # vLLM infers the method from the head's name
    assert SpeculativeConfig(model="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
                             num_speculative_tokens=2).method == "eagle3"
    with pytest.raises(ConfigError, match="method='eagle3' needs speculative_config.model"):
        SpeculativeConfig(method="eagle3", num_speculative_tokens=2)

    def head(name, **kwargs):
        return write_eagle3_head(tmp_path / name, tiny_llama_dir, **kwargs)
    config = kiln_config(eagle3_spec(heads[2])).speculative_config.draft_model_config
    assert (config.hidden_size, config.hf_config.target_hidden_size) == (96, 64)
    bad = {"hidden_size=32": head("h", hidden_size=32),
           "target_hidden_size=32": head("t", target_hidden_size=32),
           "names the target's in target_hidden_size": head("w", hidden_size=32),
           "vocab_size=600": head("v", vocab_size=600),
           "draft_vocab_size=900": head("d", draft_vocab_size=900),
           "num_hidden_layers=0": head("n", num_hidden_layers=0),
           # a 2-layer target: vLLM's default (2, 1, -1) names no layer -1
           "layer(s) [-1] outside the target's 0..2": head("a", aux_ids=None),
           "layer(s) [5] outside": head("b", aux_ids=[0, 1, 5]),
           "name 2 distinct layer(s)": head("c", aux_ids=[0, 1, 1]),
           "use_aux_hidden_state=false": head("u", eagle_config={"use_aux_hidden_state": False}),
           "not an EAGLE-3 Llama head": write_head(tmp_path / "e1", tiny_llama_dir)}
    for message, path in bad.items():
        with pytest.raises(ConfigError, match="--speculative-config") as e:
            kiln_config(eagle3_spec(path))
        assert message in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="runs under method='eagle3'"):
        kiln_config({"method": "eagle", "model": str(heads[0]), "num_speculative_tokens": 2})
    # a head is no model to serve
    with pytest.raises(ConfigError, match="an EAGLE draft head, not a model.*eagle3"):
        EngineArgs(model=str(heads[0]), load_format="dummy").create_kiln_config()


def test_checkpoints_that_cannot_map_draft_ids_are_refused_at_load(tiny_llama_dir, tmp_path):
    from kiln.config.kiln_config import set_current_kiln_config
    from kiln.engine.arg_utils import EngineArgs
    from kiln.spec_decode.eagle_proposer import Eagle3Proposer

    def load(path):
        config = EngineArgs(model=str(tiny_llama_dir), speculative_config=eagle3_spec(path),
                            dtype="float32").create_kiln_config()
        proposer = Eagle3Proposer(config, config.device_config.device_obj)
        target = SimpleNamespace(model=SimpleNamespace(embed_tokens=None), lm_head=None)
        with set_current_kiln_config(proposer.kiln_config):
            proposer.load(target)

    def with_d2t(name, edit):  # a head with its own embedding whose d2t `edit` changes
        path = write_eagle3_head(tmp_path / name, tiny_llama_dir, draft_vocab=200,
                                 own_embed=True)
        weights = load_file(str(path / "model.safetensors"))
        edit(weights["d2t"])
        save_file(weights, str(path / "model.safetensors"))
        return path

    def duplicate(d2t):  # draft id 1 onto draft id 0's target id
        d2t[1] = d2t[0] - 1

    for message, path in (
            ("has no d2t", write_eagle3_head(tmp_path / "d", tiny_llama_dir, draft_vocab=200,
                                              d2t=False)),
            # the first draft step failed with an IndexError, taking the engine down
            ("maps draft id 197 to target id", with_d2t("far", lambda d: d[-3:].add_(600))),
            ("maps draft id 0 to target id -", with_d2t("neg", lambda d: d[:1].sub_(1000))),
            (r"1 draft id\(s\) onto a target id another", with_d2t("dup", duplicate)),
            # a head of another width: the target's embedding / LM head cannot stand in
            ("hidden_size=96 differs from the target's .* no embed_tokens", write_eagle3_head(
                tmp_path / "we", tiny_llama_dir, draft_vocab=200, width=96)),
            ("hidden_size=96 differs .* no lm_head.weight", write_eagle3_head(
                tmp_path / "wl", tiny_llama_dir, own_embed=True, own_lm_head=False, width=96)),
            ("has no lm_head.weight, and its draft_vocab_size=200", write_eagle3_head(
                tmp_path / "l", tiny_llama_dir, draft_vocab=200, own_embed=True,
                own_lm_head=False))):
        with pytest.raises(ConfigError, match=message):
            load(path)


def test_a_head_quantizing_only_its_kv_cache_is_served_in_the_targets_cache(
        inprocess_core, tiny_llama_dir, heads, tmp_path):
    """A compressed-tensors head with a kv_cache_scheme and no config_groups has float linears:
    served (it was refused as a quantized head, to be replaced by its float checkpoint), its
    scales read into its layer, which runs in the float target's cache (auto: 1.0)."""
    import json
    import shutil

    import torch

    head = tmp_path / "kv_head"
    shutil.copytree(heads[0], head)
    config = json.loads((head / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
        "ignore": [], "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                          "dynamic": False, "symmetric": True}}
    (head / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(head / "model.safetensors"))
    tensors.update({"midlayer.self_attn.k_scale": torch.tensor(0.5),
                    "midlayer.self_attn.v_scale": torch.tensor(2.0)})
    save_file(tensors, str(head / "model.safetensors"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = generate(make(tiny_llama_dir, eagle3_spec(heads[0])), PROMPTS, params)
    llm = make(tiny_llama_dir, eagle3_spec(head))
    assert [o.token_ids for o in generate(llm, PROMPTS, params)] == [o.token_ids for o in want]
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    layers = list(runner.drafter.attention_layers.values())
    assert [(a.checkpoint_scales, a.impl.k_scale) for a in layers] == [({"k": 0.5, "v": 2.0}, 1.0)]
