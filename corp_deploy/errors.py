"""The one exception type that carries a user-facing message."""


class CorpError(Exception):
    """Bad input or an unsupported request, with a message meant for the user.

    The CLI prints the message and exits with ``exit_code`` (1 unless a subclass says
    otherwise) without a traceback; library callers can catch it like any exception.
    """

    exit_code = 1


class SettingError(CorpError):
    """A CorpError about settings whose message names them: ``template`` has one ``{}`` per name
    in ``settings`` (Python field names, e.g. ``s_mlp``). The CLI renders the same message with
    its option names (``--s-mlp``) through :meth:`naming`."""

    def __init__(self, template: str, *settings: str) -> None:
        self.template, self.settings = template, settings
        super().__init__(template.format(*settings))

    def naming(self, name) -> str:
        """The message with each setting written as ``name(setting)``."""
        return self.template.format(*map(name, self.settings))
