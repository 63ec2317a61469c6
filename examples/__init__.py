"""Three small data-parallel implementations, written the way users write their own, each with
its ddpcheck target in a few lines (see docs/your-own-ddp.md).

- ``explicit_finish``: a wrapper with an explicit finish method, plus a ZeRO-1 optimizer;
- ``sync_in_backward``: a wrapper that synchronises inside backward, like torch's DDP;
- ``reset_after_step``: a wrapper whose loop must call ``model.reset()`` after every step.

They import nothing from ``parallel`` (independent implementations) and only ddpcheck's public
API. Each module has ``TARGET`` (correct) and ``BUGGY`` (one seeded bug from
docs/bug-catalogue.md).
"""
