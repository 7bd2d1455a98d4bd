"""The one exception type that carries a user-facing message."""


class CorpError(Exception):
    """Bad input or an unsupported request, with a message meant for the user.

    The CLI prints the message and exits with ``exit_code`` (1 unless a subclass says
    otherwise) without a traceback; library callers can catch it like any exception.
    """

    exit_code = 1


class SettingError(CorpError):
    """A CorpError about settings whose message names them: ``template`` holds one
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


class SettingConflict(SettingError):
    """Settings that exclude each other; on the command line, bad usage (exit status 2)."""

    exit_code = 2


#: Where a :class:`SettingError` names a setting.
SETTING = "{setting}"


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (at most ``limit`` characters), or its type's name."""
    return (str(exc).splitlines() or [""])[0][:limit] or type(exc).__name__


def check_choice(setting: str, value: str, choices: tuple[str, ...]) -> None:
    """SettingError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise SettingError(f"{SETTING} must be one of {', '.join(choices)}; got {value!r}", setting)
