"""The warm server, in a thread of the test process: served answers equal in-process ones byte for byte,
many clients at once, hostile clients, a cache replaced while held, the memory bound, the protocol."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time

import pytest

import kvcli
from kvcli.serve import client, protocol
from kvcli.requests import SessionSpec
from kvcli.serve.warm import Warm
from tests.conftest import sample_text, tiny_llama
from tests.helpers import assert_clean_error, error_lines, json_lines, run, run_python
from tests.serve_helpers import ThreadServer, ask_events, install_copy, raw_request, short_dir

QUESTIONS = ["What is the Licensor?", "Is there a warranty?", "Who may use the work?"]


@pytest.fixture(scope="module")
def world(tiny_model_dir, tokenizer):
    from kvcli.engine.prefilling import prefill

    root = short_dir()
    text = sample_text()
    (root / "a.txt").write_text(text[:1400], encoding="utf-8")
    (root / "b.txt").write_text(text[1400:2600], encoding="utf-8")
    lm = kvcli.load(str(tiny_model_dir))
    for k in "ab":
        prefill(lm, kvcli.read_document(root / f"{k}.txt"), root / f"ref-{k}.kv")
    other = root / "other-model"
    tiny_llama(len(tokenizer), seed=1).save_pretrained(other)
    tokenizer.save_pretrained(other)
    prefill(kvcli.load(str(other)), kvcli.read_document(root / "a.txt"), root / "other.kv")
    yield {"root": root, "lm": lm, "model": tiny_model_dir}
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def server(world):
    srv = ThreadServer(world["root"] / "s.sock")
    yield srv
    srv.close()


@pytest.fixture
def here(world, server, monkeypatch):
    """Work in the world's folder (relative cache paths) with KVCLI_SOCKET naming the thread server."""
    monkeypatch.chdir(world["root"])
    monkeypatch.setenv("KVCLI_SOCKET", str(server.path))
    return world["root"]


def served_count(server) -> int:
    return sum(c["answers"] for c in server.server.warm.status()["caches"])


def test_plain_answers_are_byte_identical(here, server):
    args = ("ask", "-c", "ref-a.kv", *QUESTIONS, "--max-new-tokens", "12")
    before = served_count(server)
    served, local = run(*args), run(*args, "--no-server")
    assert served.exit_code == local.exit_code == 0, served.stderr
    assert served_count(server) == before + len(QUESTIONS)
    assert served.stdout == local.stdout and served.stdout.count("==> ") == len(QUESTIONS)
    assert served.stderr == local.stderr
    nul = run(*args, "-0", "--stop", "e")
    assert nul.stdout == run(*args, "-0", "--stop", "e", "--no-server").stdout and nul.stdout.count("\0") == len(QUESTIONS)


def test_json_answers_are_identical_but_for_timing_and_served(here):
    args = ("ask", "-c", "ref-a.kv", "-c", "ref-b.kv", *QUESTIONS[:2], "--max-new-tokens", "10", "--json")
    served, local = json_lines(run(*args, "--server").stdout), json_lines(run(*args, "--no-server").stdout)
    assert [r["served"] for r in served] == [True] * 4 and [r["served"] for r in local] == [False] * 4
    strip = lambda rows: [{k: v for k, v in r.items() if not k.endswith("_s") and k != "served"} for r in rows]  # noqa: E731
    assert strip(served) == strip(local)
    assert [list(r) for r in served] == [list(r) for r in local]  # same fields in the same order
    assert served[0]["cache"] == "ref-a.kv"  # the path as the user spelled it


def _batch_of(server, cache) -> dict:
    (row,) = [c for c in server.server.warm.status()["caches"] if c["path"] == str(cache)]
    return row["batch"]


def test_questions_of_one_request_decode_together(here, server):
    for name in ("together.kv", "apart.kv"):
        shutil.copytree(here / "ref-b.kv", here / name, dirs_exist_ok=True)
    args = ("ask", *QUESTIONS, "--max-new-tokens", "10")
    together = run(*args, "-c", "together.kv", "--server")
    apart = run(*args, "-c", "apart.kv", "--server", "--batch-size", "1")
    local = run(*args, "-c", "together.kv", "--no-server", "--batch-size", "1")
    assert together.exit_code == apart.exit_code == local.exit_code == 0, together.stderr
    assert together.stdout == apart.stdout == local.stdout and together.stdout.count("==> ") == len(QUESTIONS)
    assert _batch_of(server, here / "together.kv")["peak_rows"] == len(QUESTIONS)  # one forward pass ran all three
    assert _batch_of(server, here / "apart.kv")["peak_rows"] == 1  # --batch-size 1: one question at a time, as asked
    ps = json.loads(run("ps", "--json").stdout)
    assert any(c["batch"] == {"width": 8, "asked": 3, "steps": c["batch"]["steps"], "peak_rows": 3} for c in ps["caches"])


def test_errors_are_the_same_through_the_server(here, world):
    for args in (("-c", "gone.kv", "-c", "ref-a.kv", "Q?"), ("-c", "other.kv", "Q?", "--model", str(world["model"])), ("-c", "gone.kv", "Q?")):
        served = run("ask", "--max-new-tokens", "4", *args)
        local = run("ask", "--max-new-tokens", "4", *args, "--no-server")
        assert served.exit_code == local.exit_code == 3, (served.stderr, local.stderr)
        assert served.stdout == local.stdout and served.stderr == local.stderr
        assert "Traceback" not in served.stderr
    assert "gone.kv: no cache here" in served.stderr  # relative, as given


def _served_failure(server, cache, **fields) -> dict:
    events = ask_events(server.path, cache, "Q?", **fields)
    assert events[-1]["event"] == "fail", events
    return events[-1]


def test_bad_options_from_a_socket_client_are_refused_as_the_cli_refuses_them(here, server):
    """A client that skips the CLI's checks gets the CLI's message and exit 2 (kvcli/generation.py), never a
    silent reinterpretation: a string `stop` is not one stop per character."""
    cache = here / "ref-a.kv"
    for cli_args, options in ((("--top-p", "0"), {"top_p": 0}), (("--repetition-penalty", "0"), {"repetition_penalty": 0})):
        local = run("ask", "-c", "ref-a.kv", "Q?", *cli_args, "--no-server")
        assert local.exit_code == 2, local.stderr
        fail = _served_failure(server, cache, options={"max_new_tokens": 2, **options})
        assert fail["exit_code"] == 2 and error_lines(local) == [f"kvcli: error: {fail['message']}"]
    fail = _served_failure(server, cache, options={"max_new_tokens": 2, "stop": "abc"})
    assert fail["exit_code"] == 2 and "--stop must be a list of strings, not one string" in fail["message"]
    for options in ({"max_new_tokens": 0}, {"max_new_tokens": True}, {"seed": "x"}, {"temperature": -1}, {"stop": [""]},
                    {"no_repeat_ngram_size": -1}, {"bogus": 1}):
        assert _served_failure(server, cache, options=options)["exit_code"] == 2, options
    local = run("ask", "-c", "ref-a.kv", "Q?", "--trust-remote-code", "--no-server")
    fail = _served_failure(server, cache, trust_remote_code=True)
    assert local.exit_code == fail["exit_code"] == 2 and error_lines(local) == [f"kvcli: error: {fail['message']}"]
    assert "--trust-remote-code needs an explicit --model" in fail["message"]


def test_server_option_requires_one(here, monkeypatch, tmp_path):
    monkeypatch.setenv("KVCLI_SOCKET", str(short_dir() / "none.sock"))
    assert_clean_error(run("ask", "-c", "ref-a.kv", "Q?", "--server"), 1, "no kvcli server answers")
    result = run("ask", "-c", "ref-a.kv", "Q?", "--max-new-tokens", "3", "--json")  # no server: in-process
    assert result.exit_code == 0 and json_lines(result.stdout)[0]["served"] is False
    assert_clean_error(run("ps"), 1, "no kvcli server answers")
    assert_clean_error(run("serve", "--stop"), 1, "no kvcli server answers")
    monkeypatch.setenv("KVCLI_SOCKET", "/tmp/" + "x" * 200 + ".sock")  # longer than a unix socket path may be
    result = run("ask", "-c", "ref-a.kv", "Q?", "--max-new-tokens", "3", "--json")
    assert result.exit_code == 0 and json_lines(result.stdout)[0]["served"] is False
    assert_clean_error(run("serve"), 1, "too long")


def test_served_client_imports_nothing_heavy(here):
    code = (
        "import sys\n"
        "from kvcli.cli import app\n"
        "try:\n    app(['ask', '-c', 'ref-a.kv', 'What?', '--max-new-tokens', '4', '--server'], prog_name='kvcli')\n"
        "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        # pydantic: typer 0.29+ imports it to coerce options, 90 ms of every served `ask` (pinned below 0.29)
        "heavy = [m for m in ('torch', 'transformers', 'safetensors', 'numpy', 'pydantic') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = run_python(code, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


def test_prefill_through_the_server(here, world):
    served = run("prefill", "a.txt", "-o", "p.kv", "--model", str(world["model"]), "--json", "--force")
    assert served.exit_code == 0, served.stderr
    (row,) = json_lines(served.stdout)
    assert row["served"] is True and row["cache"] == "p.kv" and row["document"] == "a.txt"
    assert kvcli.verify("p.kv").token_ids == kvcli.verify("ref-a.kv").token_ids
    refused = run("prefill", "a.txt", "-o", "p.kv", "--model", str(world["model"]))
    local = run("prefill", "a.txt", "-o", "p.kv", "--model", str(world["model"]), "--no-server")
    assert refused.exit_code == local.exit_code == 1 and refused.stderr == local.stderr


def test_every_prefill_path_reports_the_one_record(here, world):
    """In-process, served and --from-list prefills (one document, several, one failing) report records of the same
    keys, through the one driver (engine.corpus.run); a failure is a record too, beside its error line."""
    from tests.helpers import PREFILL_RECORD

    model = str(world["model"])
    (here / "rec").mkdir(exist_ok=True)
    (here / "rec" / "bad.txt").write_bytes(b"\xff\xfe not utf-8")
    (here / "list.txt").write_text("a.txt\nb.txt\n", encoding="utf-8")
    runs = {
        "served": run("prefill", "a.txt", "-o", "rec/s.kv", "--model", model, "--json", "--force"),
        "in-process": run("prefill", "a.txt", "-o", "rec/l.kv", "--model", model, "--json", "--force", "--no-server"),
        "served, several": run("prefill", "a.txt", "rec/bad.txt", "-o", "rec/several", "--model", model, "--json", "--force"),
        "in-process, several": run("prefill", "a.txt", "rec/bad.txt", "-o", "rec/several-l", "--model", model, "--json", "--force",
                                   "--no-server"),
        "list": run("prefill", "--from-list", "list.txt", "-o", "rec/listed", "--model", model, "--json"),
    }
    rows = {name: json_lines(r.stdout) for name, r in runs.items()}
    assert all(set(row) == PREFILL_RECORD for name in rows for row in rows[name]), rows
    assert [r["served"] for r in rows["served"] + rows["served, several"]] == [True] * 3
    assert [r["status"] for r in rows["list"]] == ["built", "built"] and rows["list"][0]["served"] is False
    for name in ("served, several", "in-process, several"):
        assert runs[name].exit_code == 1 and [(r["document"], r["status"]) for r in rows[name]] == [("rec/bad.txt", "failed"),
                                                                                                      ("a.txt", "built")]
        assert "rec/bad.txt" in rows[name][0]["error"] and str(here) not in rows[name][0]["error"]  # spelled as given
        assert "1 built, 0 skipped, 1 failed of 2 documents" in runs[name].stderr and "1 of 2 documents failed" in runs[name].stderr
    strip = lambda r: {k: v for k, v in r.items() if k not in ("cache", "served", "seconds", "bytes_on_disk") and not k.endswith("_s")}  # noqa: E731
    assert strip(rows["served"][0]) == strip(rows["in-process"][0]) == strip(rows["list"][0])  # compressed sizes may differ in bits


def test_prefill_kv_bits_through_the_server_equals_in_process(here, world, server):
    """--kv-bits travels to the server: the served 8-bit cache holds the same shards as an in-process one."""
    served = run("prefill", "a.txt", "-o", "q8.kv", "--model", str(world["model"]), "--kv-bits", "8", "--json", "--force")
    assert served.exit_code == 0, served.stderr
    (row,) = json_lines(served.stdout)
    assert row["served"] is True and row["storage"] == "8-bit" and "8-bit" in served.stderr
    local = run("prefill", "a.txt", "-o", "q8-local.kv", "--model", str(world["model"]), "--kv-bits", "8", "--no-server", "--force")
    assert local.exit_code == 0, local.stderr
    a, b = kvcli.verify("q8.kv"), kvcli.verify("q8-local.kv")
    assert a.quant == b.quant and a.quant["bits"] == 8 and [x.digest for x in a.layers] == [x.digest for x in b.layers]
    bad = raw_request(server.path, protocol.encode({"op": "prefill", "docs": [[str(here / "a.txt"), str(here / "x.kv")]], "kv_bits": 3}))
    assert bad[-1]["event"] == "fail" and "kv_bits" in bad[-1]["message"] and not (here / "x.kv").exists()


def test_prefill_weights_travel_to_the_server(here, world):
    """--weights reaches the server's model load: a served q8 cache records q8 as an in-process one does (their
    shards differ in bits: bfloat16 activations show where a prefill was cut, engine/model/stored.py)."""
    served = run("prefill", "a.txt", "-o", "w.kv", "--model", str(world["model"]), "--weights", "q8", "--json", "--force")
    assert served.exit_code == 0, served.stderr
    (row,) = json_lines(served.stdout)
    assert row["served"] is True
    local = run("prefill", "a.txt", "-o", "w-local.kv", "--model", str(world["model"]), "--weights", "q8", "--force", "--no-server")
    assert local.exit_code == 0, local.stderr
    a, b = kvcli.verify("w.kv"), kvcli.verify("w-local.kv")
    assert a.weights == b.weights == "q8" and a.token_ids == b.token_ids


def _reference(world, cache, question, n):
    return kvcli.Session(world["lm"], cache).ask(question, kvcli.GenerationOptions(max_new_tokens=n)).answer_token_ids


def test_concurrent_clients_each_get_their_own_answer(here, world, server):
    jobs = [("ref-a.kv" if i % 2 else "ref-b.kv", QUESTIONS[i % 3]) for i in range(8)]
    results: dict[int, list] = {}

    def one(i, cache, q):
        results[i] = ask_events(server.path, here / cache, q, max_new_tokens=10)

    threads = [threading.Thread(target=one, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i, (cache, q) in enumerate(jobs):
        answers = [e["answer"] for e in results[i] if e["event"] == "answer"]
        assert results[i][-1] == {"v": protocol.PROTOCOL_VERSION, "event": "done", "exit_code": 0}
        assert answers[0]["answer_token_ids"] == _reference(world, here / cache, q, 10)
        assert "".join(e["text"] for e in results[i] if e["event"] == "text") == answers[0]["answer"]


def test_hostile_clients_affect_nobody_else(here, world, server):
    path = server.path
    garbage = raw_request(path, b"\x00\xffnot json at all\n")
    assert garbage[-1]["event"] == "fail" and "bad request" in garbage[-1]["message"]
    endless = raw_request(path, b"x" * (protocol.MAX_LINE + 65536))
    assert endless[-1]["event"] == "fail" and "longer than" in endless[-1]["message"]
    other = raw_request(path, json.dumps({"v": 99, "op": "ask"}).encode() + b"\n")
    assert other[-1]["event"] == "fail" and "protocol version 99" in other[-1]["message"]
    unknown = raw_request(path, protocol.encode({"op": "format-disk"}))
    assert unknown[-1]["event"] == "fail" and "unknown op" in unknown[-1]["message"]
    bad = raw_request(path, protocol.encode({"op": "ask", "caches": "x", "questions": ["q"]}))
    assert bad[-1]["event"] == "fail" and "caches" in bad[-1]["message"]

    cancelled = server.server.counts["cancelled"]
    quitter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # asks for a long answer, reads one event, leaves
    quitter.connect(str(path))
    quitter.sendall(protocol.encode({"op": "ask", "caches": [str(here / "ref-a.kv")], "questions": ["Go on"], "options": {"max_new_tokens": 4000}}))
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # connects and never sends a whole line
    silent.connect(str(path))
    silent.sendall(b'{"v": 2, "op"')
    reader = quitter.makefile("rb")
    assert json.loads(reader.readline())["event"] == "accepted"
    reader.readline()
    reader.close()
    quitter.close()
    events = ask_events(path, here / "ref-b.kv", QUESTIONS[0], max_new_tokens=10)  # meanwhile, a normal client
    assert events[-1]["event"] == "done"
    assert [e for e in events if e["event"] == "answer"][0]["answer"]["answer_token_ids"] == _reference(world, here / "ref-b.kv", QUESTIONS[0], 10)
    deadline = time.monotonic() + 60
    while server.server.counts["cancelled"] == cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.server.counts["cancelled"] == cancelled + 1  # the quitter's generation was stopped
    silent.close()
    assert client.ping(path)["pid"] == os.getpid()


def test_client_refuses_another_protocol_version(tmp_path):
    path = short_dir() / "old.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def old_server():
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b'{"v": 0, "event": "accepted"}\n')
        conn.close()

    t = threading.Thread(target=old_server)
    t.start()
    with pytest.raises(client.ProtocolMismatch, match="protocol version 0"):
        client.open_request(path, "ask", {})
    t.join(timeout=10)
    listener.close()


def test_replaced_cache_is_restored_again(here, world, server):
    held = here / "held.kv"
    shutil.rmtree(held, ignore_errors=True)
    shutil.copytree(here / "ref-a.kv", held)
    first = json_lines(run("ask", "-c", "held.kv", QUESTIONS[0], "--max-new-tokens", "8", "--json", "--server").stdout)[0]
    assert first["answer_token_ids"] == _reference(world, here / "ref-a.kv", QUESTIONS[0], 8)
    reloads = server.server.warm.reloads
    install_copy(held, here / "ref-b.kv")
    second = json_lines(run("ask", "-c", "held.kv", QUESTIONS[0], "--max-new-tokens", "8", "--json", "--server").stdout)[0]
    assert second["answer_token_ids"] == _reference(world, here / "ref-b.kv", QUESTIONS[0], 8)
    assert second["cached_tokens"] == len(kvcli.read_manifest(here / "ref-b.kv").token_ids)
    assert server.server.warm.reloads == reloads + 1
    install_copy(held, here / "other.kv")  # now a cache of another model: refused, exit 3, as in-process
    served = run("ask", "-c", "held.kv", "Q?", "--model", str(world["model"]), "--server")
    assert_clean_error(served, 3, "held.kv")
    assert served.stderr == run("ask", "-c", "held.kv", "Q?", "--model", str(world["model"]), "--no-server").stderr


def test_memory_bound_evicts_least_recently_used(world):
    warm = Warm(max_memory=1 << 40)
    with warm.session(SessionSpec((str(world["root"] / "ref-a.kv"),))) as lease:
        lease.ask("Q?", kvcli.GenerationOptions(max_new_tokens=2))
    status = warm.status()
    model_bytes, cache_bytes = status["models"][0]["bytes"], status["caches"][0]["bytes"]
    warm.max_memory = model_bytes + cache_bytes + cache_bytes // 2  # room for the model and one cache
    with warm.session(SessionSpec((str(world["root"] / "ref-b.kv"),))):
        pass
    status = warm.status()
    assert [os.path.basename(c["path"]) for c in status["caches"]] == ["ref-b.kv"]
    assert status["bytes"] <= warm.max_memory and len(status["models"]) == 1
    a_spec, b_spec = SessionSpec((str(world["root"] / "ref-a.kv"),)), SessionSpec((str(world["root"] / "ref-b.kv"),))
    with warm.session(a_spec) as a, warm.session(b_spec) as b:  # in use: both kept
        assert len(warm.status()["caches"]) == 2 and a.session is not b.session
    assert len(warm.status()["caches"]) == 1  # back under the bound once released


def test_ps_shows_what_is_held(here, server):
    run("ask", "-c", "ref-a.kv", "Q?", "--max-new-tokens", "2", "--server")
    result = run("ps", "--json")
    assert result.exit_code == 0, result.stderr
    s = json.loads(result.stdout)
    assert s["pid"] == os.getpid() and s["protocol"] == protocol.PROTOCOL_VERSION
    assert any(c["path"] == str(here / "ref-a.kv") and c["answers"] >= 1 and c["bytes"] > 0 for c in s["caches"])
    assert s["models"] and s["bytes"] <= s["max_memory"]
    human = run("ps", env={"COLUMNS": "250"})
    assert human.exit_code == 0 and "ref-a.kv" in human.stdout and str(server.path) in human.stdout
    assert "most together" in human.stdout and " of 8" in human.stdout


def test_usage_errors():
    assert_clean_error(run("serve", "--max-memory", "lots"), 2, "--max-memory")
    assert_clean_error(run("serve", "--idle-timeout", "soon"), 2, "--idle-timeout")
    from kvcli.units import parse_duration, parse_size

    assert parse_size("8G") == 8 << 30 and parse_size("1.5GB") == 1_500_000_000 and parse_duration("10m") == 600


def test_socket_path_rule(monkeypatch, tmp_path):
    from kvcli.engine.model.models import kvcli_home

    monkeypatch.delenv("KVCLI_SOCKET")
    assert client.socket_path() == kvcli_home() / "kvcli.sock" == client.kvcli_home() / "kvcli.sock"
    monkeypatch.setenv("KVCLI_SOCKET", "rel.sock")
    assert client.socket_path() == tmp_path.cwd() / "rel.sock"


def test_evicting_a_model_closes_its_engine(world):
    """Asked in turn through two models with room for nothing idle, the warm server loads and evicts a model per
    question: each eviction closes that model's engine, so threads and engines stay at what one round leaves, the
    evicted models are freed, and every answer stays right."""
    import gc
    import weakref

    from kvcli.engine.scheduling import scheduler

    warm = Warm(max_memory=1)  # nothing stays once given back
    specs = [SessionSpec((str(world["root"] / name),)) for name in ("ref-a.kv", "other.kv")]
    opts = kvcli.GenerationOptions(max_new_tokens=4)
    first, models, counts = None, [], []
    try:
        for _round in range(4):
            answers = []
            for spec in specs:
                with warm.session(spec) as lease:
                    answers.append(lease.ask(QUESTIONS[0], opts).answer_token_ids)
                    models.append(weakref.ref(lease.session.lm.model))
                del lease  # the test's own reference
            first = first or answers
            assert answers == first
            assert warm.status()["models"] == []  # evicted once given back
            gc.collect()
            counts.append((len([t for t in threading.enumerate() if t.name.startswith("kvcli-")]), len(scheduler._engines)))
        assert all(c[0] <= counts[0][0] and c[1] <= counts[0][1] for c in counts), counts  # bounded: as after round 1
        assert sum(ref() is not None for ref in models) == 0  # no evicted model is held by anything
    finally:
        warm.close()
