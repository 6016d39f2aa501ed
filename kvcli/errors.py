"""One hierarchy of errors, each carrying the exit code the CLI turns it into."""

from __future__ import annotations

# Not an error: `kvcli ask --check` printed every answer, and at least one differs from a full recompute.
CHECK_DIFFERS_EXIT = 4


def extra_hint(what: str, extra: str) -> str:
    """The hint for an optional extra that is not installed: what needs it, and the line that installs it."""
    return f"{what} need the optional extra: pip install 'kvcli[{extra}]' (in a checkout: pip install -c constraints.txt -e '.[{extra}]')"


class KvcliError(Exception):
    """Base of every error kvcli reports to a user: a one-line message and an exit code."""

    exit_code = 1
    hint: str | None = None

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        if hint is not None:
            self.hint = hint


class UsageError(KvcliError):
    """The command line itself is wrong (missing or contradictory arguments)."""

    exit_code = 2


class DocumentError(KvcliError):
    """A document cannot be used: unreadable, empty, not text, too long for the model."""


class ModelError(KvcliError):
    """A model cannot be found, loaded, or cached (unsupported layer kinds)."""


class GenerationError(KvcliError):
    """Answering failed for a reason other than the cache (e.g. the prompt outgrows the model)."""


class PromptTooLongError(GenerationError):
    """The prompt (document, any earlier turns, the question) needs every position the model has, or more."""

    LEAD = "question too long: "

    @property
    def reason(self) -> str:
        """What does not fit, without the lead (chat and HTTP say it their own way)."""
        return str(self).removeprefix(self.LEAD)


class CacheError(KvcliError):
    """A cache is missing, corrupt, of an unknown format, or does not fit the model: rebuild it."""

    exit_code = 3


class CacheMissingError(CacheError):
    """No cache at the path (no valid manifest)."""


class CacheCorruptError(CacheError):
    """The manifest or a shard fails validation or its checksum."""


class CacheVersionError(CacheError):
    """The cache is of a format version this kvcli cannot read."""


class CacheMismatchError(CacheError):
    """The cache was built for another model, tokenizer, dtype or prompt framing."""


class BlendError(CacheError):
    """These caches cannot be blended into one prompt: the model's keys cannot move, or the caches do not join."""


class CacheExistsError(KvcliError):
    """Refusing to replace an existing cache without --force."""

    exit_code = 1


class CacheBusyError(CacheExistsError):
    """Another prefill is writing this cache now."""


class ServerError(KvcliError):
    """The warm server is absent when required, refused a request, or went away mid-answer."""


class ConversationError(UsageError):
    """A conversation cannot follow the cached document: malformed turns, or another system message.

    `field` names the offending part (e.g. `messages[2].role`) for the HTTP server's 400 answers."""

    def __init__(self, message: str, *, field: str | None = None, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.field = field
