"""Plans in the form other training systems take (``dapple export``;
``docs/export.md``). No torch here.

- :mod:`.shape`: what every target takes, one degree of each kind for all
  stages (:class:`~.shape.RunShape`), the refusals naming what a target
  cannot express, and what ``--approximate`` changed instead;
- :mod:`.module_map`: the modules of a model that hold each profile layer
  (torchtitan's Llama, dapple's GPT, or a map file);
- :mod:`.torchtitan`, :mod:`.megatron`, :mod:`.deepspeed`: one target each.
"""
