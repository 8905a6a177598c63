"""Running vLLM: the supervised process, serve/exec, multi-node launch, tune and its load
generator.
"""
