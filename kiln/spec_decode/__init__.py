"""Speculative decoding, vLLM V1's model-free n-gram method (prompt lookup): the scheduler
proposes drafts (ngram_proposer.py, scheduling.py), the model runner verifies them in one forward
(verifier.py), rejection sampling keeps the target distribution (rejection_sampler.py)."""
