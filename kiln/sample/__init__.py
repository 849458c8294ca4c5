"""Token sampling: penalties, sampling filters, seeded per-request draws and logprobs."""
