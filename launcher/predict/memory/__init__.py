"""Memory: the budget model (vLLM's start-up accounting), the KV cache's specs, one candidate's
memory, the KV re-cut after a post-pass, and the KV memory vLLM measured on an earlier boot.
"""
