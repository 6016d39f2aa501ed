"""Options spelled once, shared by every command. Choices are Literal types: typer checks them while
parsing (exit 2 naming the allowed values, before anything loads) and lists them in --help."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

Device = Literal["auto", "cpu", "cuda", "mps"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", metavar="MODEL", help="Hub id, model folder or .gguf file (default: $KVCLI_MODEL, else the embedded SmolLM2-135M-Instruct).")]
CacheModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", metavar="MODEL", help="Hub id, model folder or .gguf file to answer with (default: the model the cache was built with).")]
RevisionOpt = Annotated[Optional[str], typer.Option(metavar="REV", help="Hub revision (branch, tag or commit).")]
DeviceOpt = Annotated[Device, typer.Option(help="auto: CUDA or MPS when present, else CPU.")]
DtypeOpt = Annotated[Dtype, typer.Option(help="Compute dtype (auto: float32 on CPU, the model's own on an accelerator).")]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Run the model repository's own Python code (only for models you trust).")]
FramingOpt = Annotated[Literal["auto", "chat", "plain"], typer.Option(help="auto: the chat template if the model has one, else plain.")]
SystemOpt = Annotated[Optional[str], typer.Option(metavar="TEXT", help="System text placed before the document.")]
EncodingOpt = Annotated[str, typer.Option(metavar="NAME", help="Text encoding of the documents (any Python codec: utf-8, latin-1, utf-16, ...).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Nothing on stderr but errors.")]
ServerOpt = Annotated[Optional[bool], typer.Option("--server/--no-server", help="Require a running `kvcli serve` / never use one (default: use one, starting it in the background if none runs, unless KVCLI_AUTOSTART=0 or CI is set).", show_default=False)]
SocketOpt = Annotated[Optional[Path], typer.Option("--socket", metavar="PATH", help="The server's socket (default: $KVCLI_SOCKET, else $KVCLI_HOME/kvcli.sock).", show_default=False)]
WeightsOpt = Annotated[Optional[Literal["float", "q8", "q4", "gguf"]], typer.Option(help="gguf (the default for a .gguf file): the file's own low-bit weights, read from the mapped file by kvcli's kernels, bfloat16 activations by default (CPU, approximate: docs/exactness.md); float (the default for any other model, and the exactness mode: answers equal transformers' token for token): the weights as transformers dequantizes them; q8: any model's weights as int8 per output channel; q4: a GGUF model's Q4_1 weights as stored (other models': quantized in groups of 32).")]
CacheDtypeOpt = Annotated[Optional[Literal["float32", "bfloat16", "float16"]], typer.Option(help="Compute dtype (default: the cache's).")]
FollowUpOpt = Annotated[Optional[Path], typer.Option("--follow-up", metavar="FILE", help="Continue the conversation of the last line of this `ask --json` output ('-' for stdin).", show_default=False)]
# sampling options that ask and chat spell alike
TemperatureOpt = Annotated[float, typer.Option(metavar="T", help="0 for greedy (default).")]
TopPOpt = Annotated[float, typer.Option(metavar="P", help="Nucleus sampling threshold, above 0 and at most 1 (with --temperature).")]
SeedOpt = Annotated[Optional[int], typer.Option(metavar="S", help="Seed for reproducible sampling (0 to 2^64-1).")]
RepetitionPenaltyOpt = Annotated[float, typer.Option(metavar="R", help="Above 1 makes tokens already in the prompt or answer less likely (generate()'s own; 1: off).")]
NoRepeatNgramOpt = Annotated[int, typer.Option(metavar="N", help="Never repeat an N-token sequence of the prompt or answer (0: off).")]
StopLoopsOpt = Annotated[int, typer.Option(metavar="N", help="End an answer once its last N tokens come a third time in it: a small model caught in a loop (0: never; the tokens before are unchanged).")]
IdsOpt = Annotated[bool, typer.Option("--ids", help="With --json: also every prompt id of each answer (prompt_token_ids; large).")]
ConvertDtypeOpt = Annotated[bool, typer.Option("--convert-dtype", help="Allow a model dtype different from the cache's (answers may differ).")]
