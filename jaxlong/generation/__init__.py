"""Generation on the training mesh (docs/generation.md).

* `jaxlong.generation.decode` — the prefill (the training forward, returning each layer's K/V split by sequence
  over the devices) and the cached decode step (split-KV attention merged exactly across the shards), sampling.
* `jaxlong.generation.generate` — batches of prompts (left-padded to a length the mesh takes), the decode loop,
  EOS and stop strings, streaming.
"""
