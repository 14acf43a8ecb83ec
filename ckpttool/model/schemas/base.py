"""The spec of a key schema: what one trainer's flattened state dict looks like, in one record.

A :class:`SchemaSpec` is registered with :mod:`ckpttool.model.schemas.registry`; detection,
the catalog, discovery, the ``--schema`` choices and the ``docs/design.md`` §2 table ask the
registry, so adding a trainer's schema is one module (a spec) and its tests. Torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckpttool.model.catalog import ParamGroup

__all__ = [
    "CANONICAL_MODEL_PREFIX",
    "COUNTER_ITEMS",
    "canonical_group_key",
    "canonical_state_key",
    "GENERIC_DISCOVERY",
    "GENERIC_TRAINING_STATE_ITEMS",
    "CommonState",
    "Detected",
    "Discovery",
    "FolderPair",
    "GroupMembers",
    "SchemaSpec",
    "canonical_model_key",
    "per_parameter_key",
    "per_rank_spec",
    "split_per_parameter_key",
]

#: The model prefix of the torch-native spelling ``model.<fqn>`` (what export rules match, whatever the schema).
CANONICAL_MODEL_PREFIX = "model."


def canonical_model_key(fqn: str) -> str:
    """The torch-native spelling ``model.<fqn>`` of parameter ``fqn`` (the key export rules and filters match)."""
    return CANONICAL_MODEL_PREFIX + fqn


def canonical_state_key(fqn: str, field_name: str) -> str:
    """The torch-native spelling ``optimizer.state.<fqn>.<field>`` of a state field (diff's common namespace)."""
    return f"optimizer.state.{fqn}.{field_name}"


def canonical_group_key(fqn: str) -> str:
    """The torch-native spelling ``optimizer.param_groups.<fqn>`` of a parameter's flattened param group."""
    return f"optimizer.param_groups.{fqn}"


#: Top-level items trainers save beside model and optimizer (scheduler, data loader, step, RNG),
#: whatever the schema; a spec adds its own (:attr:`SchemaSpec.training_state_items`).
GENERIC_TRAINING_STATE_ITEMS: tuple[str, ...] = (
    "lr_scheduler",
    "lr_schedulers",
    "scheduler",
    "schedulers",
    "dataloader",
    "data_loader",
    "train_state",
    "trainer_state",
    "training_state",
    "rng",
    "rng_state",
    "rng_states",
    "random_states",
    "extra_state",
    "step",
    "global_step",
    "epoch",
    "iteration",
    "ntokens_seen",
    "scaler",  # torch.amp.GradScaler's state_dict(), as torch's AMP recipe saves it
    "grad_scaler",
)


#: Training-state items that count (steps, epochs, tokens): saved as a number, or as a tensor of one element
#: (``ckpttool.model.counters`` reads no other). A top-level tensor of another size so named is a model's.
COUNTER_ITEMS: tuple[str, ...] = ("step", "global_step", "epoch", "iteration", "ntokens_seen")


@dataclass(frozen=True)
class FolderPair:
    """A model folder saved beside its optimizer folder by two ``dcp.save`` calls.

    Attributes:
        model: regex a model folder's name matches in full (``pytorch_model_fsdp_(\\d+)``).
        optimizer: the optimizer folder's name, ``str.format`` ed with the regex's groups (``optimizer_{0}``).
    """

    model: re.Pattern[str]
    optimizer: str


@dataclass(frozen=True)
class Discovery:
    """Directory names a trainer lays its checkpoints out with (:mod:`ckpttool.model.discovery`).

    Attributes:
        step_words: step-directory words: ``<word>[-_]?<N>`` (``step-100``, ``global_step100``, ``iter_0000100``).
        latest_files: files naming the last step (DeepSpeed ``latest``: ``global_step100``; Megatron: ``100``).
        folder_pairs: model/optimizer folder pairs, tried in order.
        step_patterns: whole step-directory names other than ``<word><N>``: regexes with a ``step``
            group and an optional ``epoch`` group (NeMo Automodel's ``epoch_<E>_step_<S>``), ordered
            by step, then epoch.
        incomplete_markers: files a trainer leaves in a step directory until its save is published.
        publish_markers: files a trainer writes into a step directory last, when its save is complete:
            ``(marker, holds)``, a step directory holding every name of ``holds`` but not ``marker``
            is a save not yet published (OLMo-core's ``.metadata.json`` beside ``model_and_optim/``
            and ``train/``); so is one holding some of them, none a checkpoint (``train/`` alone).
        staging_suffixes: suffixes of the directory a trainer saves a step into before renaming it to
            the step's name: ``<step directory><suffix>`` is a save not yet renamed (OLMo-core's
            ``Checkpointer`` saves ``stepN-tmp/`` and renames it to ``stepN/`` when every rank has written).
        staging_prefixes: prefixes of that directory, the same way: ``<prefix><step directory>``, the step directory
            named by one of this discovery's ``step_words``, is a save not yet renamed (HF Trainer, transformers
            4.36-4.38: ``tmp-checkpoint-N/``, renamed to ``checkpoint-N/``).
        step_folders: ``(folder, beside)``: a folder of a step directory that is the checkpoint, and the
            names the trainer saves beside it that ckpttool reads or opens as a checkpoint of its own.
            Any other training state in the step directory (a pickle, a folder of pickles) is named as
            not read (rule ``K012``), as for a model/optimizer pair: OLMo-core's ``model_and_optim/``
            beside ``train/`` (read); verl's ``actor/`` beside ``critic/`` (a checkpoint of its own),
            its ``data.pt`` (the data loader's state, which verl's resume loads) named.
        latest_fallback: those of ``latest_files`` whose trainer's resume, when the step they name is not there,
            loads the highest complete step instead of failing (NeMo Automodel's ``find_latest_checkpoint``:
            ``LATEST`` whose target is no directory).
        latest_required: ``(file, without)``: a ``latest`` file the trainer's resume needs to load any step, and
            what that resume does without it (verl's ``find_latest_ckpt_path`` returns ``None`` when
            ``latest_checkpointed_iteration.txt`` is not there, and its ``resume_mode`` ``auto`` trains from
            scratch): ``--step latest`` from a run root of such steps without the file says so, and ``validate``
            names it (``R008``). Several entries: the trainers that save such steps each resume from one of the
            files (Megatron-LM's ``latest_checkpointed_iteration.txt``, Megatron Bridge's ``latest_train_state.pt``),
            so a root holding any of them is resumed; the first is the one named.
    """

    step_words: tuple[str, ...] = ()
    latest_files: tuple[str, ...] = ()
    folder_pairs: tuple[FolderPair, ...] = ()
    step_patterns: tuple[re.Pattern[str], ...] = ()
    incomplete_markers: tuple[str, ...] = ()
    publish_markers: tuple[tuple[str, tuple[str, ...]], ...] = ()
    staging_suffixes: tuple[str, ...] = ()
    step_folders: tuple[tuple[str, tuple[str, ...]], ...] = ()
    latest_fallback: tuple[str, ...] = ()
    staging_prefixes: tuple[str, ...] = ()
    latest_required: tuple[tuple[str, str], ...] = ()


#: Layouts that belong to no key schema (DeepSpeed / Megatron-style step directories, split saves).
GENERIC_DISCOVERY = Discovery(
    step_words=("global_step", "globalstep", "iter", "iteration", "ckpt", "epoch"),
    latest_files=("latest", "latest_checkpointed_iteration.txt"),
    folder_pairs=(
        FolderPair(re.compile(r"^model$"), "optimizer"),
        FolderPair(re.compile(r"^model$"), "optim"),
    ),
)


@dataclass(frozen=True)
class Detected:
    """What detection found, for the specs' predicates (:attr:`SchemaSpec.claims`).

    Attributes:
        model_prefix: the model prefix chosen (``""``: top level; ``None``: no model tensors).
        optimizer_prefix: the optimizer prefix chosen (``None``: no optimizer state).
        loose_top_level: tensors at the top level voted for the top-level reading.
        naming: the naming convention of the model fqns (``hf``, ``torchtitan``, ``unknown``).
        training_state: the top-level training-state items present.
        writer: the storage writer the ``.metadata`` names when not torch's (:attr:`CheckpointMetadata.writer`:
            ``"olmo-core"``), else ``None``.
        fqns: the model fqns detection sampled (the first 4096 model tensors, in file order).
        planner: the ``.metadata`` holds ``planner_data`` (the saving planner flattened a nested state dict:
            torch's ``DefaultSavePlanner``; megatron's ``MCoreSavePlanner`` saves with ``flatten_state_dict=False``).
    """

    model_prefix: str | None
    optimizer_prefix: str | None
    loose_top_level: bool
    naming: str
    training_state: tuple[str, ...]
    writer: str | None = None
    fqns: tuple[str, ...] = ()
    planner: bool = False


@dataclass(frozen=True)
class CommonState:
    """The trainer's common state: one file beside ``.metadata`` holding what is not sharded (Megatron's
    ``common.pt``), as a schema's :attr:`SchemaSpec.read_common_state` reads it.

    Attributes:
        groups: per chained optimizer (index order), its param groups (hyperparameter dicts, no ``params``).
        common_step: per chained optimizer, the shared step (``None``: not saved / not a number).
        scheduler: the LR scheduler's saved state (``max_lr``, ``num_steps``, ...), or ``{}``.
        scheduler_item: the top-level item it was saved as (``opt_param_scheduler``).
        iteration: the saved trainer iteration, or ``None``.
        keys: the top-level keys of the file.
        values: its top-level numbers (``iteration``, ``checkpoint_version``, ``num_floating_point_operations_so_far``).
        args: the trainer's saved run arguments (Megatron-LM's ``args`` namespace, as a dict of its attributes), or
            ``None`` where it saved none.
    """

    groups: tuple[tuple[dict[str, Any], ...], ...] = ()
    common_step: tuple[float | None, ...] = ()
    scheduler: dict[str, Any] = field(default_factory=dict)
    scheduler_item: str = ""
    iteration: int | None = None
    keys: tuple[str, ...] = ()
    values: dict[str, int | float] = field(default_factory=dict)
    args: dict[str, Any] | None = None


#: ``SchemaSpec.group_members``: the common state and, per parameter with optimizer state, the key of one of its
#: state tensors and its global shape -> ``[(hyperparameters, member fqns)]`` in saved order.
GroupMembers = Callable[
    [CommonState, Mapping[str, tuple[str, tuple[int, ...]]]], list[tuple[dict[str, Any], list[str]]]
]


def named_by_format(d: Detected) -> bool:
    """The ``claims`` of a schema its per-rank file format names (verl, torch-checkpointing): DCP keys never do."""
    return False


@dataclass(frozen=True, kw_only=True)
class SchemaSpec:
    """One key schema (``docs/design.md`` §2), as registered.

    Attributes:
        name: the schema id (``torch-native``), reported by ``inspect`` and given to ``--schema``.
        model_prefix, optimizer_prefix: the prefixes ``--schema <name>`` reads the keys with
            (default ``model.`` / ``optimizer.``, torch's ``{"model": ..., "optimizer": ...}``).
        model_container: the nesting of the model's state dict in the saved dict: ``()`` top
            level, ``("model",)`` for ``{"model": sd}``, ``(None, "model")`` for
            ``{<any app>: {"model": sd}}`` (``None``: any name); by default the model prefix's
            components (``model.``: ``("model",)``; ``""``: ``()``), read as :attr:`container`.
            Detection reads model-prefix candidates from it (planner paths, else key prefixes).
        claims: detection predicate: is a checkpoint with these findings of this schema? Specs
            are asked in priority order; the first that claims it names it.
        priority: the order specs are asked in (lower first; the registry keeps ties in
            registration order).
        optimizer_heads: top-level names of the optimizer's state dict (``optimizer``); an
            optimizer key is ``[<app>.]<head>.state.<fqn>.<field>`` or ``...param_groups...``.
        training_state_items: top-level items it saves beside model and optimizer (reported, never exported).
        prefix_notes: extra reasons once the prefixes are chosen (model prefix, optimizer prefix -> lines).
        fused_rules: parameters an optimizer steps fused while the model stores them split
            (regex over the fqn, model-key templates formatted with its groups).
        discovery: directory names its trainer lays checkpoints out with.
        import_help: what ``ckpttool import --schema <name>`` writes (``None``: not an import target).
        split_state_key: for a schema whose optimizer keys are not ``<prefix>state.<fqn>.<field>``
            (Megatron-core: ``[chained_N.]optimizer.state.<field>.<key>``): key -> ``(fqn, field)``
            of an optimizer state key, ``None`` for any other key.
        optimizer_key: whether a key belongs to the optimizer though :attr:`split_state_key` maps it to no
            parameter (Megatron-core's ``chained_N.optimizer.distributed.*`` buckets): never a model tensor.
        files_read: files of the checkpoint folder besides the data files that the schema reads (Megatron's
            ``common.pt``: its param groups and step): never named as training state not read.
        scheduler_per_step: its trainer steps the LR scheduler once per optimizer step, so a saved
            ``last_epoch`` behind the step is a stale scheduler (``R002``); ``False`` where the trainer is not
            known (plain ``dcp.save``: a scheduler stepped once per epoch is as likely, ``R004``).
        lr_set_before_step: how its trainer sets each param group's ``lr`` before the optimizer step, from a schedule
            the checkpoint does not save (a clause; OLMo-core's train module): the saved ``lr`` is then the one of the
            saved step, not the one its next step takes, and ``replay-step`` says so (``""``: its scheduler steps
            after the optimizer, so the saved ``lr`` is the next step's).
        step_dir_is_trainer_step: its trainer names each step directory by the trainer step the save holds
            (torchtitan's ``step-N`` holds ``train_state.step`` N; OLMo-core's ``stepN/`` holds ``global_step`` N in
            ``train/rankR.pt``), so a directory that names another step holds another step's save (``R002``).
        step_dir_range: ``(lo, hi)``: the step a save in the step directory of step ``N`` holds (the trainer's, else
            the optimizer's, else the LR scheduler's) is within ``[N + lo, N + hi]`` (``None``: unbounded); ``(0, 0)``:
            exactly ``N`` (torchtitan, OLMo-core).
        several_optimizer_steps_per_step: its trainer takes a varying number of optimizer steps per trainer step
            while its LR scheduler and step directory count trainer steps (verl's PPO: one per mini-batch,
            ``ppo_epochs`` times, the scheduler once per update): the optimizer's ``step`` is compared with neither
            (``R002``).
        stacked_layers: fqn prefixes of parameters stored with every layer stacked on dim 0 (Megatron-core's
            ``decoder.layers.``: ``decoder.layers.mlp.linear_fc1.weight [L, out, in]``); layer ``i`` of such a
            tensor is ``<prefix><i>`` (``decoder.layers.3``), as ``stats`` groups it.
        common_state_file: the file beside ``.metadata`` holding its trainer's common state (Megatron's
            ``common.pt``: iteration, param groups, LR scheduler), read by :attr:`read_common_state`.
        read_common_state: reads the bytes of :attr:`common_state_file` safely, ``(data, shown)`` -> the state
            (``shown``: the file as messages name it; raises ``CkptError``); asked once per opened checkpoint
            (``Catalog.common_state``), which fetches the bytes confined, regular and capped
            (``--max-object-size``) from a local folder or the checkpoint's object-store prefix alike, and gives
            ``None`` without asking where there is no such file. The iteration counts as a trainer step
            (``R002``), the file's numbers are a trainer-state row of ``inspect``.
        read_trusted_common_state: :attr:`read_common_state` for a checkpoint opened with ``trust_pickle``
            (``--trust-pickle``): it may read the file with ``torch.load(weights_only=False)``; ``None``: the file is
            read by :attr:`read_common_state` all the same.
        common_state_required: why its trainer's load fails without :attr:`common_state_file` (``K014``; ``""``:
            the file is optional).
        common_state_problems: inconsistencies within the common state (``R002``): ``(key, message)`` pairs.
        group_load_problems: param groups of the common state its trainer's load cannot restore as saved (``P008``):
            ``(key, message)`` pairs.
        group_members: its param groups are saved in the common state without their parameters: the members
            inferred by its trainer's default rule (:data:`GroupMembers`); the catalog's groups are these.
        shared_step_params: the parameters (of those :attr:`group_members` takes) whose state holds the step the
            common state saves once per optimizer, whatever their group: ``None`` where it is only the members'.
        inferred_groups_note: the warning ``replay-step`` gives when the replayed parameters' groups (inferred by
            :attr:`group_members`) differ in hyperparameters: (groups used, parameters chosen, hyperparameters
            that differ) -> the note.
        skips_overflow_steps: its trainer skips the optimizer step of an iteration whose gradients overflowed (its
            own loss scaler, not saved as a ``GradScaler``) while the iteration counts: the optimizer's step may be
            behind the trainer's (``R002``).
        skip_step_groups: whether its param groups (``keys``: hyperparameter name -> item) are those of the trainer's
            own skip-step optimizer, which leaves a step whose loss or gradient norm spikes out of its ``step`` while the
            trainer counts it (OLMo-core's ``SkipStepAdamW``): the optimizer's step may then be behind (``R002``), and
            its moments are in the dtype it was configured with (``dtype``), not the parameter's (``O005``).
        skip_step_saved_by: the class of that optimizer, as ``inspect``'s ``saved_by`` names it for a parameter of
            such a group whose state torch's AdamW would save too (``olmo_core.optim.SkipStepAdamW``).
        per_parameter_optimizers: the optimizer item (``optimizer.``) its trainer may save as ``{fqn:
            optimizer.state_dict()}`` of one optimizer per parameter (torchtune's ``OptimizerInBackwardWrapper``,
            ``optimizer_in_bwd``): keys ``<item><fqn>.state.0.<field>`` and ``<item><fqn>.param_groups.0.<hyper>``
            (:func:`split_per_parameter_key`), read as that parameter's state and its own param group (flattened
            flavor) where no other optimizer state is found; ``""``: none.
        per_parameter_resume: what the trainer's own resume does with that per-parameter state, where it does not
            restore it all (``K007``, info); ``""``: it does.
        index_state_by_param_order: optimizer state keyed by parameter index is the parameters' order in the
            model's state dict (torchtune builds its optimizer from ``model.parameters()``): renamed to the fqns.
        reshard_refusal: ``(why, hint)`` when ``reshard`` cannot rewrite its checkpoints (E602), else ``None``.
        config_file, config_problem: a config file beside ``.metadata`` that its trainer's load reads, and why that
            load would refuse the folder's copy (``None``: it would not; ``K013``).
        restores_trainer_state_beside: its trainer's load restores the trainer state from files beside the
            checkpoint folder (:func:`ckpttool.model.beside.trainer_state_missing` names them missing, ``K011``).
        publish_note: how its trainer publishes a step directory (a clause); a checkpoint folder opened inside a
            step directory not yet published is named with it (``K011``; ``""``: not checked).
        import_adapters_by_model_type: ``(model_type glob, adapter)``: ``import --schema <name>`` needs a model
            adapter of the schema's own, the first whose glob matches the config's ``model_type`` where ``--adapter``
            is not given (torchtitan's).
        import_through_own_adapter: ``import --schema <name>`` writes through its own adapter (``--adapter`` one of
            its own, else the first).
        import_checks_hf_model: ``import --schema <name>`` writes the HF model class's own keys (``model.<key>``), so
            an import with a config checks them against that class (the keys ``dcp.load`` into it asks for).
        import_writes_stacked: ``import --schema <name>`` writes with the stacked-layer writer
            (:mod:`ckpttool.ops.import_megatron`: layers stacked on dim 0, experts by global index, no plain FSDP
            expert chunks) and the trainer's config file and common state beside ``.metadata``.
        own_names_warning: the warning of an export without a model adapter that wrote its model under the
            trainer's own names (``{count}`` tensors, ``{shown}`` examples); ``""``: the generic warning.
        doc_model, doc_optimizer, doc_written_by: its row of the ``docs/design.md`` §2 table (markdown).
    """

    name: str
    claims: Callable[[Detected], bool]
    model_prefix: str = "model."
    optimizer_prefix: str = "optimizer."
    model_container: tuple[str | None, ...] | None = None
    priority: int = 50
    optimizer_heads: tuple[str, ...] = ("optimizer",)
    training_state_items: tuple[str, ...] = ()
    prefix_notes: Callable[[str | None, str | None], tuple[str, ...]] | None = None
    fused_rules: tuple[tuple[re.Pattern[str], tuple[str, ...]], ...] = ()
    discovery: Discovery = Discovery()
    import_help: str | None = None
    split_state_key: Callable[[str], tuple[str, str] | None] | None = None
    optimizer_key: Callable[[str], bool] | None = None
    files_read: tuple[str, ...] = ()
    scheduler_per_step: bool = True
    lr_set_before_step: str = ""
    step_dir_is_trainer_step: bool = False
    step_dir_range: tuple[int | None, int | None] = (0, 0)
    several_optimizer_steps_per_step: bool = False
    stacked_layers: tuple[str, ...] = ()
    common_state_file: str | None = None
    read_common_state: Callable[[bytes, str], CommonState | None] | None = None
    read_trusted_common_state: Callable[[bytes, str], CommonState | None] | None = None
    common_state_required: str = ""
    common_state_problems: Callable[[CommonState], Iterator[tuple[str, str]]] | None = None
    group_load_problems: Callable[[CommonState], Iterator[tuple[str, str]]] | None = None
    group_members: GroupMembers | None = None
    shared_step_params: Callable[[CommonState, Mapping[str, tuple[str, tuple[int, ...]]]], list[str]] | None = None
    inferred_groups_note: Callable[[Sequence[ParamGroup], set[str], list[str]], str] | None = None
    skips_overflow_steps: bool = False
    skip_step_groups: Callable[[Sequence[ParamGroup]], bool] | None = None
    skip_step_saved_by: str | None = None
    index_state_by_param_order: bool = False
    per_parameter_optimizers: str = ""
    per_parameter_resume: str = ""
    reshard_refusal: tuple[str, str] | None = None
    config_file: str = ""
    config_problem: Callable[[Path], str | None] | None = None
    restores_trainer_state_beside: bool = False
    publish_note: str = ""
    own_names_warning: str = ""
    import_adapters_by_model_type: tuple[tuple[str, str], ...] = ()
    import_through_own_adapter: bool = False
    import_writes_stacked: bool = False
    import_checks_hf_model: bool = False
    doc_model: str = ""
    doc_optimizer: str = ""
    doc_written_by: str = ""

    @property
    def container(self) -> tuple[str | None, ...]:
        """:attr:`model_container`, or where not given the model prefix's components (``""``: ``()``)."""
        if self.model_container is not None:
            return self.model_container
        return tuple(self.model_prefix.split(".")[:-1])

    @property
    def choice(self) -> str:
        """The Python name of its ``--schema`` choice (``torch_native``)."""
        return self.name.replace("-", "_")

    def stacked_prefix(self, fqn: str) -> str | None:
        """The prefix of :attr:`stacked_layers` under which ``fqn`` holds every layer stacked on dim 0
        (``decoder.layers.mlp.linear_fc1.weight [L, out, in]``), else ``None``: also for one layer's own
        ``decoder.layers.<N>.`` fqn, which megatron-core saves for a block of mixed layer types (dense and MoE
        layers, ``moe_layer_freq``: ``TransformerBlock.sharded_state_dict``'s ``non_homogeneous_layers``)."""
        p = next((p for p in self.stacked_layers if fqn.startswith(p)), None)
        return None if p is None or fqn[len(p) :].split(".", 1)[0].isdecimal() else p


#: The parts of one parameter's optimizer state dict in a save of one optimizer per parameter
#: (:attr:`SchemaSpec.per_parameter_optimizers`), each holding that optimizer's parameter 0 / group 0 only.
PER_PARAMETER_PARTS = ("state", "param_groups")


def split_per_parameter_key(key: str, item: str) -> tuple[str, str, str] | None:
    """``(part, fqn, name)`` of a key of one optimizer per parameter under ``item`` (``optimizer.``):
    ``optimizer.<fqn>.state.0.<field>`` -> ``("state", fqn, field)``, ``optimizer.<fqn>.param_groups.0.<hyper>`` ->
    ``("param_groups", fqn, hyper)``; ``None`` for any other key (torch's ``optimizer.state.<i>.<field>``, an index
    other than 0: an optimizer over several parameters). The last such part wins (field and hyperparameter names
    hold no dots), so an fqn may hold ``.state.0.`` itself. Linear in the key's length."""
    if not item or not key.startswith(item):
        return None
    rest = key[len(item) :]
    for part in PER_PARAMETER_PARTS:
        fqn, sep, name = rest.rpartition(f".{part}.0.")
        if sep and fqn and name and "." not in name:
            return part, fqn, name
    return None


def per_parameter_key(item: str, part: str, fqn: str, name: str = "") -> str:
    """The key :func:`split_per_parameter_key` splits into ``(part, fqn, name)`` (``name`` ``""``: the part's
    prefix without a trailing dot, ``optimizer.<fqn>.param_groups.0``)."""
    return f"{item}{fqn}.{part}.0" + (f".{name}" if name else "")


def per_rank_spec(
    name: str,
    *,
    priority: int,
    doc_optimizer: str,
    doc_written_by: str,
    discovery: Discovery = Discovery(),
    **steps: Any,
) -> SchemaSpec:
    """The spec of a trainer's per-rank ``torch.save`` files (not DCP), which
    :mod:`ckpttool.format.perrank_formats` assembles into torch's flattened keys ``model.<fqn>``,
    ``optimizer.state.<fqn>.<field>`` and ``lr_scheduler.<field>``: chosen by the file format
    (:func:`named_by_format`), never by key detection."""
    return SchemaSpec(
        name=name,
        claims=named_by_format,
        priority=priority,
        training_state_items=("lr_scheduler",),
        discovery=discovery,
        doc_model="`model.<fqn>` (assembled)",
        doc_optimizer=doc_optimizer,
        doc_written_by=doc_written_by,
        **steps,
    )
