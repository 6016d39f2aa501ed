"""The root typer app: plain help, --version, and the one place kvcli errors become a stderr line and an exit code."""

from __future__ import annotations

import difflib
import functools
import traceback
from typing import Annotated

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup
from typer._click import exceptions as click_errors  # typer's own click: its exceptions are the ones raised

from .. import __version__
from ..errors import KvcliError, UsageError
from .output import EXIT_PIPE, Output, debug_enabled, is_broken_pipe, stdout_gone

EXIT_CODES = ("Exit codes: 0 ok, 1 failure, 2 usage error, 3 cache missing/corrupt/stale (rebuild it), "
              "4 ask --check: an answer differs from a full recompute.")


def _one_shape(parse):
    """Wrap a click parsing step so every usage error it raises (typer's range and choice checks, an
    unknown option or command, a missing value) takes kvcli's one documented shape: `kvcli: error: ...`
    and a hint naming --help on stderr, exit 2."""

    @functools.wraps(parse)
    def wrapper(*args, **kwargs):
        try:
            return parse(*args, **kwargs)
        except click_errors.NoArgsIsHelpError:
            raise  # plain `kvcli` / a bare group: help, not an error
        except click_errors.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "kvcli"
            Output().error(exc.format_message(), f"'{where} --help' lists the options")
            raise typer.Exit(UsageError.exit_code) from None

    return wrapper


class _Group(TyperGroup):
    """The root group: an unknown command or option gets the one-line error shape too; --help lists each command
    with its whole first sentence."""

    make_context = _one_shape(TyperGroup.make_context)

    def resolve_command(self, ctx, args):
        name = args[0] if args else ""
        if name and not name.startswith("-") and self.get_command(ctx, name) is None:
            close = difflib.get_close_matches(name, self.list_commands(ctx), n=1)
            guess = f"; did you mean {close[0]!r}?" if close else ""
            Output().error(f"no such command {name!r}{guess}", "'kvcli --help' lists the commands")
            raise typer.Exit(UsageError.exit_code)
        return _one_shape(TyperGroup.resolve_command)(self, ctx, args)

    def format_commands(self, ctx, formatter) -> None:
        rows = [(name, cmd.get_short_help_str(limit=10_000)) for name in self.list_commands(ctx)
                if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


app = typer.Typer(
    cls=_Group,
    help=f"Prefill a long document once into a compressed KV cache, then ask it many questions. {EXIT_CODES}",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class _Help(TyperCommand):
    """Plain click-style help: metavars and choices, not typer's type labels (<bool>, <list[str]>);
    usage errors (typer's range and choice checks included) in kvcli's one-line shape."""

    make_context = _one_shape(TyperCommand.make_context)

    def collect_usage_pieces(self, ctx) -> list[str]:
        """The usage line: an argument that takes several values as DOC... ([QUESTION]... when optional)."""
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                name = param.metavar or param.name.upper()
                pieces.append((name if param.required else f"[{name}]") + ("..." if param.nargs != 1 else ""))
            else:
                pieces.extend(param.get_usage_pieces(ctx))
        return pieces

    def format_options(self, ctx, formatter) -> None:
        rows: dict[str, list[tuple[str, str]]] = {"Arguments": [], "Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if isinstance(param, TyperArgument):
                name = param.metavar or param.name.upper()
                rows["Arguments"].append((name + ("..." if param.nargs != 1 else ""), record[1]))
            else:
                rows["Options"].append(record)
        for title, items in rows.items():
            if items:
                with formatter.section(title):
                    formatter.write_dl(items)


def command(fn):
    """Register a command and map kvcli errors to one stderr line and an exit code, in one place."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = Output(quiet=kwargs.get("quiet", False))
        try:
            code = fn(*args, **kwargs)
        except OSError as exc:
            if not is_broken_pipe(exc):
                return _unexpected(out, exc)
            stdout_gone()  # the reader left (e.g. `| head`): stop quietly, as Unix tools do
            raise typer.Exit(EXIT_PIPE) from None
        except KvcliError as exc:
            if debug_enabled():
                traceback.print_exc()
            out.error(exc, exc.hint)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            out.error("interrupted")
            raise typer.Exit(130) from None
        except (typer.Exit, typer.Abort):
            raise
        except Exception as exc:  # a bug or an unforeseen failure: one line, traceback on request
            return _unexpected(out, exc)
        if code:
            raise typer.Exit(code)

    return app.command(cls=_Help)(wrapper)


def _unexpected(out: Output, exc: Exception):
    if debug_enabled():
        traceback.print_exc()
    out.error(f"unexpected {exc.__class__.__name__}: {exc}", "set KVCLI_DEBUG=1 for a traceback")
    raise typer.Exit(1) from None


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False) -> None:
    pass
