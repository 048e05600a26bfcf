"""Speculative decoding's pieces: proposers that guess a request's next tokens cheaply, and the
verification that keeps what the target model would have produced (greedy: token for token;
sampled: in distribution)."""
