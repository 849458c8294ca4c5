"""A decoder layer whose attention and MLP both read one LayerNorm of the layer's input, their
sum added to it (Phi-1 / 1.5 / 2, Cohere's Command-R): h + attn(ln(h)) + mlp(ln(h))."""
from kiln.model.layers.layernorm import LayerNorm
from kiln.model.llama import LlamaDecoderLayer


class ParallelBlockDecoderLayer(LlamaDecoderLayer):
    norm_cls = LayerNorm
    eps_field = "layer_norm_eps"

    def __init__(self, hf_config, prefix: str):
        super().__init__(hf_config, prefix)
        del self.post_attention_layernorm  # the one norm feeds both branches

    def forward(self, positions, hidden, residual):
        if residual is None:
            h, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, h = self.input_layernorm(hidden, residual)  # h: the layer's input
        # the next layer (or the final norm) adds h: (attn + mlp) + h, HF Phi's order
        return self.self_attn(positions, normed) + self.mlp(normed), h
