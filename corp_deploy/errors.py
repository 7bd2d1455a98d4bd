"""The exception types that carry a user-facing message, and the checks of settings' values."""

import dataclasses
import numbers
import typing

#: Where corp-deploy's own code lives: its warnings are shown (other libraries' are not), and a module
#: of it that cannot be imported is a bug, not a dependency missing from the installation.
OWN_MODULES = r"(corp_deploy|exporters|benchmarks)(\.|$)"

#: The exit statuses of the commands (their meanings: ``corp_deploy.cli.group.EXIT_CODES``), named
#: once here, below every command and library that ends with one.
EXIT_FAILURE = 1
EXIT_BAD_USAGE = 2
#: export: the files are written, and a step needs TensorRT or a GPU to finish.
EXIT_INCOMPLETE = 3
#: A gate failed (export's parity: nothing is written; bench's limits: the reports are written).
EXIT_GATE_FAILED = 4
#: The output is complete, and a step after it failed (printing the results).
EXIT_OUTPUT_COMPLETE = 5


class CorpError(Exception):
    """Bad input or an unsupported request, with a message meant for the user.

    The CLI prints the message and exits with ``exit_code`` (1 unless a subclass says
    otherwise) without a traceback; library callers can catch it like any exception.
    """

    exit_code = EXIT_FAILURE


class BadUsage(CorpError):
    """A value refused as such, whatever the files and models it names: out of its range, of the
    wrong type, not one of the choices, malformed, doing nothing, or given with settings it
    excludes or without those it needs. On the command line, bad usage: exit status 2 (what a
    value names that cannot be used, a missing file or a model timm cannot build, is exit 1)."""

    exit_code = EXIT_BAD_USAGE


class SettingError(BadUsage):
    """A :class:`BadUsage` whose message names the settings: ``template`` holds one
    :data:`SETTING` per name in ``settings`` (Python field names, e.g. ``s_mlp``). The CLI renders the
    same message with its option names (``--s-mlp``) through :meth:`naming`. Only the placeholders
    are replaced, so values quoted in the message may hold any characters."""

    def __init__(self, template: str, *settings: str) -> None:
        if template.count(SETTING) != len(settings):
            raise ValueError(f"{template!r} needs one {SETTING} per setting")
        self.template, self.settings = template, settings
        super().__init__(self.naming(str))

    def naming(self, name) -> str:
        """The message with each setting written as ``name(setting)``."""
        parts = self.template.split(SETTING)
        return "".join(
            part + (name(setting) if i < len(self.settings) else "")
            for i, (part, setting) in enumerate(zip(parts, [*self.settings, ""]))
        )


#: Where a :class:`SettingError` names a setting.
SETTING = "{setting}"


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (at most ``limit`` characters; surrounding blank
    lines and spaces dropped), or its type's name when it has none: a reason in a sentence, without
    a library's multi-line details."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__


def check_choice(setting: str, value: str, choices: tuple[str, ...]) -> None:
    """SettingError unless ``value`` is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        got = repr(value) if isinstance(value, str) else described(value)
        raise SettingError(f"{SETTING} must be one of {', '.join(choices)}; got {got}", setting)


def check_choices(setting: str, values: object, choices: tuple[str, ...]) -> None:
    """SettingError unless ``values`` is a tuple of one or more of ``choices``, each once."""
    named = isinstance(values, tuple) and all(isinstance(value, str) for value in values)
    if not (named and values and set(values) <= set(choices) and len(set(values)) == len(values)):
        got = repr(",".join(values)) if named else described(values)
        raise SettingError(f"{{setting}} takes one or more of {','.join(choices)}, each once; got {got}", setting)


def check_instance(name: str, value: object, kind: type | tuple[type, ...], what: str | None = None) -> None:
    """CorpError naming a wrong type as such: ``config must be a CompressConfig, not dict``; ``what``
    says what is expected where the type's name would not (required for a tuple of types)."""
    if not isinstance(value, kind):
        if what is None:
            what = f"{'an' if kind.__name__[0] in 'AEIOU' else 'a'} {kind.__name__}"
        raise BadUsage(f"{name} must be {what}, not {type(value).__name__}")


def check_flags(**flags: object) -> None:
    """BadUsage naming the first of ``flags`` (a public function's boolean arguments, by name) that is
    not a bool: ``in_place="no"`` would otherwise count as true."""
    for name, value in flags.items():
        check_instance(name, value, bool, "True or False")


def check_setting_types(settings: object, setting: typing.Callable[[str], str] = str) -> None:
    """SettingError for the first field of the dataclass ``settings`` whose value is not of its
    annotated type (float: any real number but a bool; int: an integer but a bool; str; bool; each
    possibly ``| None``), named as a wrong type (``s_mlp must be a number, got str '0.5'``), so that
    range checks only ever see numbers; a NumPy number is accepted and stored as Python's (so the
    settings serialise to JSON). Fields of other types are left to their own checks.
    ``setting``: the setting each field is named as (``recover_steps`` for ``RecoveryConfig.steps``)."""
    hints = typing.get_type_hints(type(settings))
    for field in dataclasses.fields(settings):
        kinds = typing.get_args(hints[field.name]) or (hints[field.name],)
        value = getattr(settings, field.name)
        if value is None and type(None) in kinds:
            continue
        expected = [_TYPE_NAMES[kind] for kind in kinds if kind in _TYPE_NAMES]
        if len(expected) < len([kind for kind in kinds if kind is not type(None)]):
            continue  # another type too (a Path, a class, a string choice beside a count): checked elsewhere
        if not any(_is(value, kind) for kind in kinds if kind in _TYPE_NAMES):
            raise SettingError(
                f"{SETTING} must be {' or '.join(expected)}, got {described(value)}", setting(field.name)
            )
        if isinstance(value, numbers.Number) and type(value) not in (int, float, bool):  # NumPy's, as Python's
            object.__setattr__(settings, field.name, int(value) if _is(value, int) else float(value))


#: What each checked type is called in messages.
_TYPE_NAMES = {float: "a number", int: "an integer", str: "a string", bool: "true or false"}


def _is(value: object, kind: type) -> bool:
    """Whether ``value`` is of ``kind``; NumPy's numbers count as numbers, a bool never does."""
    if kind is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    return isinstance(value, kind)


def described(value: object) -> str:
    """A value in a message, with its type where a string or another type could pass for a number
    (``str '0.5'``, ``list [1]``): ``0.5`` for numbers and None."""
    if value is None or isinstance(value, (int, float)):
        return repr(value)
    return f"{type(value).__name__} {value!r}"
