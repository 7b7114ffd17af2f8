"""Context-parallel attention over the mesh `data x fsdp x ring x context`, one module per method:

  dispatch  the model's one entry, `attention_sublayer(x, weights, positions, segment_ids, ctx)`, by
            `attention.impl`.
  ulysses   Ulysses (all-to-all over `context`), and the Ulysses x ring hybrid when `mesh.ring` > 1.
  upipe     U-Pipe (head-chunked Ulysses in stages), and U-Pipe x ring; its memory model
            (`attention_memory_model`).
  ring      ring attention over `ring` (zigzag layout, `custom_vjp`), the across-node half of both.

The configs a mesh cannot run are rejected by `jaxlong.config.validate` before tracing (`ulysses.check_heads`,
`upipe.check_upipe_schedule`, `ring.check_ring`), and again by the ops themselves when called directly.
"""
