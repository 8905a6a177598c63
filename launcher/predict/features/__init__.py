"""Serving features: MTP/speculative decoding, tool and reasoning parsers, the all-to-all backend,
the KV connectors, and what each vLLM version can do (capabilities).
"""
