"""The layers models are built from: tensor-parallel linears and embeddings, attention, norms,
activations, rope, the MoE block and quantized linears (quantization/), all calling Kiln's IR ops."""
