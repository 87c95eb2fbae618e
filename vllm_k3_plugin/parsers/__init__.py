"""The vLLM glue of the readers: ``format`` events into vLLM's parser APIs, delta and
message types, and the serving hooks that report how an output ended.

The only layer of the parser side that imports vLLM; it adds no reading rule.
"""
