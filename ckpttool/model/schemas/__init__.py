"""Key schemas: where a checkpoint keeps its model tensors, optimizer state and other items (``docs/design.md`` §2).

:mod:`.base` (the :class:`~.base.SchemaSpec` of one schema), :mod:`.registry` (the registered
specs, in priority order), one module per built-in schema (:mod:`.torch_native`,
:mod:`.app_state`, :mod:`.torchtitan`, :mod:`.megatron`, :mod:`.top_level`, :mod:`.verl`,
:mod:`.torch_checkpointing`, :mod:`.olmo_core`, :mod:`.nemo`, :mod:`.torchtune`), :mod:`.keyschema` (the
:class:`~.keyschema.KeySchema` of one checkpoint, the user's override) and :mod:`.detect`
(detection). Adding a trainer's schema: one module with a ``SchemaSpec``, registered.
Torch-free.
"""
