"""Compression settings: what every method shares, and the chosen method's own options."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import BadUsage, SettingError, check_choice, check_instance, check_setting_types
from .methods import METHODS, MethodOptions, option_defaults, option_owners
from .parts import PARTS, TARGET_PARTS, TARGETS, Part
from .recovery import SETTING_PREFIX, RecoveryConfig

__all__ = ["DEFAULT_SPARSITY", "TARGETS", "TARGET_PARTS", "CompressConfig"]

#: The sparsity of every part when neither a sparsity nor a budget is given.
DEFAULT_SPARSITY = 0.5
#: The sparsity settings: the joint one, then one per part.
SPARSITY_SETTINGS = ("sparsity", *(part.setting for part in PARTS.values()))


@dataclass(frozen=True)
class CompressConfig:
    """What to prune and how (docs/method.md §1-4, §5 for the peer methods, §8 for budgets).

    Either sparsities (the same fraction of every part in every block, the paper's setting)
    or, with CORP, a MAC budget (``CorpOptions.macs`` or ``speedup``: CORP spends it where its
    closed-form errors say it hurts least). Build it with the method's options
    (``CompressConfig(s_mlp=0.5, options=CorpOptions(ridge=1e-2))``) or from flat settings as
    the command line names them (:meth:`from_settings`).

    Attributes:
        method: a name in :data:`corp_deploy.methods.METHODS`: ``corp`` (ranking plus
            closed-form ridge compensation, the default), ``vbp`` (variance-based MLP pruning,
            global ranking, mean folded into the fc2 bias) or ``toast`` (geometric-median
            coupled attention-head pruning and token channel selection for the FFN; no
            compensation step). All one-shot.
        sparsity: the fraction removed of every pruned part that has no sparsity of its own
            (the command line's ``--s``), in [0, 1); folded into ``s_mlp``, ``s_attn`` and ``s_vo``
            (and not compared or recorded itself).
        s_mlp: fraction of MLP hidden channels removed in every block, in [0, 1).
        s_attn: fraction of query/key dims removed in every attention head (``toast``: of
            query/key and of value dims), in [0, 1).
        s_vo: fraction of value dims (with their output-projection columns) removed in every
            head, in [0, 1). Each sparsity defaults to ``sparsity``, else to 0.5 without a budget;
            a part the target (or method) leaves whole has sparsity 0 (above 0 is refused).
        target: which parts are pruned (:data:`~corp_deploy.parts.TARGET_PARTS`); the other parts keep their
            dense weights whatever their sparsity says. ``None`` picks the method's default
            (``all`` for CORP with a budget).
        round_to: kept dims are rounded to a multiple of this (hardware alignment).
        compensation: fold the method's compensation in (CORP's closed-form step and drift
            refit, VBP's mean fold); False keeps the same channels and slices the weights (ablation).
            ToaSt has no compensation step, so it must stay True there.
        device: ``cpu`` or ``cuda``; where calibration runs.
        recovery: the label-free recovery after compression (:class:`~corp_deploy.recovery.RecoveryConfig`;
            its default, 0 steps, is off).
        options: the method's own settings, an instance of its ``options_class``
            (:class:`~corp_deploy.methods.CorpOptions`, ``VbpOptions``, ``ToastOptions``);
            ``None``: its defaults.
    """

    sparsity: float | None = dataclasses.field(default=None, compare=False)
    s_mlp: float | None = None
    s_attn: float | None = None
    s_vo: float | None = None
    target: str | None = None
    round_to: int = 1
    compensation: bool = True
    device: str = "cpu"
    method: str = "corp"
    options: MethodOptions | None = None
    recovery: RecoveryConfig = RecoveryConfig()

    def __post_init__(self) -> None:
        check_setting_types(self)
        check_choice("method", self.method, tuple(METHODS))
        check_instance("recovery", self.recovery, RecoveryConfig)
        method = METHODS[self.method]
        if self.options is None:
            object.__setattr__(self, "options", method.options_class())
        elif type(self.options) is not method.options_class:
            raise SettingError(
                f"{{setting}} {self.method} takes {method.options_class.__name__}, not {type(self.options).__name__}",
                "method",
            )
        else:  # this config's own copy: ``options.check`` resolves defaults that depend on the config
            object.__setattr__(self, "options", dataclasses.replace(self.options))
        if not self.compensation and not method.has_compensation:
            others = [m.name for m in METHODS.values() if m.has_compensation]
            raise SettingError(
                f"{{setting}} {self.method} has no compensation step to switch off; "
                f"{{setting}} applies to {' and '.join(others)}",
                "method",
                "compensation",
            )
        given = [name for name in SPARSITY_SETTINGS if getattr(self, name) is not None]
        if self.has_budget and given:
            raise SettingError(
                f"a MAC budget and sparsities ({', '.join('{setting}' for _ in given)}) exclude each "
                "other: the budget decides every part's size",
                *given,
            )
        if self.target is None:
            object.__setattr__(self, "target", self.options.default_target or method.default_target)
        check_choice("target", self.target, TARGETS)
        if self.target not in method.targets:
            others = [m.name for m in METHODS.values() if self.target in m.targets]
            raise SettingError(
                f"{{setting}} {self.method} prunes {method.prunes} only; {{setting}} {self.target} is not "
                f"part of it. Use {{setting}} {'/'.join(method.targets)}"
                + (f", or {{setting}} {'/'.join(others)}." if others else "."),
                "method",
                "target",
                "target",
                *(["method"] if others else []),
            )
        for name in SPARSITY_SETTINGS:
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise SettingError(f"{{setting}} must be in [0, 1), got {value!r}", name)
        self._check_sparsities_apply(method)
        self._check_joint_sparsity_applies()
        self._check_recovery_applies()
        for part in PARTS.values():  # the parts the target leaves whole keep every dim: 0
            if getattr(self, part.setting) is None and not self.has_budget:
                joint = DEFAULT_SPARSITY if self.sparsity is None else self.sparsity
                object.__setattr__(self, part.setting, joint if part.name in self.parts else 0.0)
        if self.recovery.enabled and self._keeps_every_dim():
            budget = ["speedup" if self.options.macs is None else "macs"] if self.has_budget else []
            raise SettingError(  # it would distil the dense model from itself
                "{setting} recovers what compression lost, and "
                + ("the MAC budget {setting} 1 keeps every dim" if budget else "every sparsity is 0")
                + ": the model is the dense one, with nothing to recover",
                SETTING_PREFIX + "steps",
                *budget,
            )
        if self.round_to < 1:
            raise SettingError(f"{{setting}} must be an integer >= 1, got {self.round_to!r}", "round_to")
        if self.device not in ("cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise SettingError(f"{{setting}} must be 'cpu' or 'cuda', got {self.device!r}", "device")
        self.options.check(self)

    def _check_sparsities_apply(self, method) -> None:
        """Refuse a part's own sparsity above 0 (``s_attn``, ...) for a part that the target, or
        the method, leaves whole: the artifact would record a sparsity that was never applied."""
        for part in PARTS.values():
            if not getattr(self, part.setting) or part.name in self.parts:
                continue
            if not any(part.name in TARGET_PARTS[target] for target in method.targets):
                others = [m.name for m in METHODS.values() if any(part.name in TARGET_PARTS[t] for t in m.targets)]
                raise SettingError(
                    f"{{setting}} {self.method} prunes {method.prunes} only; {{setting}} has no meaning for it "
                    f"(use {{setting}} {' or '.join(others)})",
                    "method",
                    part.setting,
                    "method",
                )
            raise SettingError(
                f"{{setting}} has no effect with {{setting}} {self.target}, which prunes "
                f"{' and '.join(self.parts)} only: choose a {{setting}} that includes it, or leave {{setting}} out",
                part.setting,
                "target",
                "target",
                part.setting,
            )

    def _keeps_every_dim(self) -> bool:
        """Whether the settings alone keep every dim: every pruned part's sparsity is 0, or the MAC
        budget is the dense MACs (``--macs 1``, ``--speedup 1``)."""
        if self.has_budget:
            return self.options.macs_fraction == 1.0
        return not any(map(self.sparsity_of, self.pruned_parts))

    def _check_joint_sparsity_applies(self) -> None:
        """Refuse the joint ``sparsity`` when every pruned part has another sparsity of its own: it
        would apply to no part, and a run would silently not do what it says. (A part's own value
        equal to the joint one applies it: so a config rebuilt by ``dataclasses.replace``, whose
        parts hold the values the joint one filled in, passes.)"""
        if self.sparsity is None:
            return
        own = [part.setting for part in self.pruned_parts if getattr(self, part.setting) not in (None, self.sparsity)]
        if len(own) == len(self.pruned_parts):
            raise SettingError(
                f"{{setting}} {self.sparsity} applies to no part: every part that {{setting}} {self.target} prunes "
                f"has a sparsity of its own ({', '.join('{setting}' for _ in own)}). "
                "Leave {setting} out, or one of those",
                "sparsity",
                "target",
                *own,
                "sparsity",
            )

    def _check_recovery_applies(self) -> None:
        """Refuse recovery settings other than their defaults when the recovery is off (0 steps):
        they would do nothing and not be recorded. (Its seed is the compression's: not counted.)"""
        if self.recovery.enabled:
            return
        default = RecoveryConfig(seed=self.recovery.seed)
        changed = [
            SETTING_PREFIX + f.name
            for f in dataclasses.fields(RecoveryConfig)
            if getattr(self.recovery, f.name) != getattr(default, f.name)
        ]
        if changed:
            raise SettingError(
                f"{', '.join('{setting}' for _ in changed)} {'applies' if len(changed) == 1 else 'apply'} only "
                "with {setting} N > 0 (the recovery is off)",
                *changed,
                SETTING_PREFIX + "steps",
            )

    @classmethod
    def from_settings(cls, **settings: Any) -> CompressConfig:
        """A config from flat settings, named as :meth:`to_dict` writes them (the command line's
        options with underscores, ``s_mlp`` for ``--s-mlp``; ``sparsity`` for ``--s``): the shared
        fields beside the options of every method and the recovery's ``recover_*``. Options of
        another method than ``settings["method"]`` must keep their defaults: they are refused, not
        ignored; a name that is none of these is refused naming them."""
        known = cls.setting_names()
        unknown = sorted(name for name in settings if name not in known)
        if unknown:
            hint = " (the command line's --s is sparsity)" if "s" in unknown else ""
            raise BadUsage(
                f"unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}{hint}; the settings "
                f"are {', '.join(sorted(known))}"
            )
        method = settings.get("method", cls.method)
        check_choice("method", method, tuple(METHODS))
        recovery = RecoveryConfig.from_settings(settings)
        settings = {name: value for name, value in settings.items() if name not in RecoveryConfig.setting_names()}
        owners, defaults = option_owners(), option_defaults()
        own = {}
        for name in [name for name in settings if name in owners]:
            value = settings.pop(name)
            if owners[name] == method:
                own[name] = value
            elif value != defaults[name]:
                raise SettingError(
                    f"{{setting}} applies to {{setting}} {owners[name]} only, not {method} (got {value!r})",
                    name,
                    "method",
                )
        return cls(**settings, options=METHODS[method].options_class(**own), recovery=recovery)

    @classmethod
    def setting_names(cls) -> set[str]:
        """The names :meth:`from_settings` takes: the shared fields, every method's options and the
        recovery's ``recover_*``."""
        shared = {field.name for field in dataclasses.fields(cls)} - {"options", "recovery"}
        return {*shared, *option_owners(), *RecoveryConfig.setting_names()}

    @classmethod
    def from_dict(cls, settings: dict[str, Any]) -> CompressConfig:
        """The config that :meth:`to_dict` wrote, from an artifact's ``settings`` (which also hold
        the calibration's, left out here)."""
        known = cls.setting_names() - {"sparsity"}  # to_dict folds the joint sparsity into the parts'
        target = settings.get("target")
        if target in TARGET_PARTS:  # the sparsities of the parts it left whole were filled in, not given
            known -= {part.setting for part in PARTS.values() if part.name not in TARGET_PARTS[target]}
        return cls.from_settings(**{name: value for name, value in settings.items() if name in known})

    @property
    def has_budget(self) -> bool:
        """The kept sizes come from a MAC budget (CORP's options), not from sparsities."""
        return self.options.has_budget

    @property
    def parts(self) -> tuple[str, ...]:
        """The names of the parts pruned, in block order (:data:`~corp_deploy.parts.TARGET_PARTS`)."""
        return TARGET_PARTS[self.target]

    @property
    def pruned_parts(self) -> tuple[Part, ...]:
        """The records of the parts pruned (:data:`~corp_deploy.parts.PARTS`)."""
        return tuple(PARTS[name] for name in self.parts)

    def sparsity_of(self, part: Part) -> float | None:
        """The sparsity setting of ``part`` (None under a budget)."""
        return getattr(self, part.setting)

    def sparsity_setting(self, part: Part) -> str:
        """The setting that gave ``part`` its sparsity, for messages: the joint ``sparsity`` (the
        command line's ``--s``) when the part's own equals it, else the part's own (``s_mlp``)."""
        own = getattr(self, part.setting)
        return "sparsity" if self.sparsity is not None and own == self.sparsity else part.setting

    @property
    def prunes_mlp(self) -> bool:
        return "mlp" in self.parts

    @property
    def prunes_attn(self) -> bool:
        """Query/key dims (``toast``: query/key and value dims) are pruned."""
        return "qk" in self.parts

    @property
    def prunes_vo(self) -> bool:
        return "vo" in self.parts

    def to_dict(self) -> dict[str, Any]:
        """The flat settings (:meth:`from_settings` and :meth:`from_dict` read them back): the
        shared fields (each part's sparsity, the joint one folded in), this method's options,
        every other method's options at their defaults, and the recovery's settings
        (``recover_steps``, ...) when it is on."""
        shared = {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name not in ("options", "sparsity", "recovery")
        }
        recovery = self.recovery.to_settings() if self.recovery.enabled else {}
        return {**shared, **option_defaults(), **self.options.to_dict(), **recovery}
