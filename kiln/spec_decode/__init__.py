"""Speculative decoding, vLLM V1's n-gram method (prompt lookup: the scheduler proposes drafts,
ngram_proposer.py, scheduling.py), its draft-model method, EAGLE-1 and EAGLE-3 (the runner proposes
them, draft_model_proposer.py, eagle_proposer.py); the model runner verifies them in one forward
(verifier.py), rejection sampling keeps the target distribution (rejection_sampler.py)."""
