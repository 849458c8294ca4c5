"""The decoder layer with a norm after each block as well as before (Gemma-2 / 3, GLM-4): each
family names its three extra norms; the residual passing is Llama's (hidden, residual) pair."""
from kiln.model.llama import LlamaDecoderLayer


class SandwichNormDecoderLayer(LlamaDecoderLayer):
    """HF: h = h + attn_out_norm(attn(input_layernorm(h)));
           h = h + mlp_out_norm(mlp(mlp_in_norm(h))).
    The norm before the MLP adds the attention branch into the residual (its fused add), and the
    layer returns (the MLP branch, h after attention) for the next layer's input norm to add."""
    # the checkpoint's names of the norm after attention, before the MLP and after the MLP
    attn_out_norm = mlp_in_norm = mlp_out_norm = ""

    def __init__(self, hf_config, prefix: str):
        super().__init__(hf_config, prefix)
        eps, hidden = hf_config.rms_norm_eps, hf_config.hidden_size
        # Llama's layer already made post_attention_layernorm; the other two are new here
        for name in (self.attn_out_norm, self.mlp_in_norm, self.mlp_out_norm):
            if not hasattr(self, name):
                setattr(self, name, self.norm_cls(hidden, eps))

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = getattr(self, self.attn_out_norm)(self.self_attn(positions, hidden))
        hidden, residual = getattr(self, self.mlp_in_norm)(hidden, residual)
        return getattr(self, self.mlp_out_norm)(self.mlp(hidden)), residual
