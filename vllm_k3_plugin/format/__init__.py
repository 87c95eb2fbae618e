"""The Kimi-K3 output format and its reading, sans-I/O: the standard library only.

- ``vocab``: every marker string and control token id, spelled once;
- ``xtml``: attribute escaping, tags as they stream, calls as the renderer writes them;
- ``marked``: structure told from text by token ids (marked text);
- ``scanner``: markers found in text fed in any chunking, in linear time;
- ``reasoning``: the channels of an output (reasoning, content, the tools channel);
- ``tools``: the calls of a tools channel;
- ``output``: one output read whole or streamed, the two readers joined;
- ``channel_ids``: channel boundaries on token ids (the engine's questions).

Nothing here imports vLLM, torch or the rest of the package (a test enforces it).
"""
