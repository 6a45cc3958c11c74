"""A real llama.cpp llama-server and random-weight GGUF models, built once and cached."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
DEFAULT_CACHE_DIR = Path(os.environ.get("GPUSWAPD_TEST_CACHE", "/var/cache/gpuswapd-test"))
# llama-spm: 32000 tokens, 0.7 MB; llama-bpe's 128k tokens would dwarf a 64-wide model.
VOCAB_NAME = "llama-spm"
# Bump when the weight generator changes, so that cached models are rewritten.
MODEL_FORMAT = 2  # 2: FIM tokens (llama-server's /infill)
# llama-server's /infill needs the vocabulary's fill-in-the-middle tokens ("prefix token is
# missing" without them); llama-spm has none, so three byte tokens no text uses (<0x00>..<0x02>)
# play them.
FIM_TOKENS = {"tokenizer.ggml.fim_pre_token_id": 3, "tokenizer.ggml.fim_suf_token_id": 4,
              "tokenizer.ggml.fim_mid_token_id": 5}

CMAKE_CONFIGURE_FLAGS: tuple[str, ...] = (
    # Portable (AVX2, not -march=native): a cache copied to another machine of this kind still runs.
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelSpec:
    """Shape and seed of one random-weight llama model."""

    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    context_length: int
    seed: int
    f16: bool = True


# slow: n_ff tuned so that a 256-token completion streams for ~3.5-4.5 s with 2 threads on the
# 2-core box when idle (~60-70 tokens/s), and longer under load.
# big: over 2 GiB on disk (2.27 GB) with few layers, so that its KV cache stays small and a
# token costs one read of the weights; for tests/benchmarks/restore_bench.py (written on first use).
MODEL_KINDS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(n_layer=2, n_embd=64, n_ff=128, n_head=4, context_length=8192, seed=1),
    "slow": ModelSpec(n_layer=8, n_embd=512, n_ff=8192, n_head=8, context_length=8192, seed=2),
    "big": ModelSpec(n_layer=11, n_embd=512, n_ff=65536, n_head=8, context_length=8192, seed=3),
}


def log(msg: str) -> None:
    """Print one progress line to stderr."""
    print(f"[llama] {msg}", file=sys.stderr, flush=True)


def llama_dir(cache_dir: Path) -> Path:
    """Return the versioned directory holding the cached binary and vocab."""
    return cache_dir / f"llama-cpp-{LLAMA_CPP_PYTHON_VERSION}"


def server_path(cache_dir: Path) -> Path:
    """Return where the cached llama-server binary lives (whether or not it exists yet)."""
    return llama_dir(cache_dir) / "llama-server"


def vocab_path(cache_dir: Path) -> Path:
    """Return where the cached vocab GGUF lives (whether or not it exists yet)."""
    return llama_dir(cache_dir) / "vocab" / f"ggml-vocab-{VOCAB_NAME}.gguf"


_lock_state = threading.local()


@contextlib.contextmanager
def _cache_lock(cache_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on the cache dir for processes and threads (reentrant per thread)."""
    key = cache_dir.resolve()
    held: set[Path] = _lock_state.__dict__.setdefault("held", set())
    if key in held:
        yield
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    # flock belongs to the open file, so other threads (own open) and processes both wait.
    with open(cache_dir / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        held.add(key)
        try:
            yield
        finally:
            held.discard(key)
            fcntl.flock(fh, fcntl.LOCK_UN)


def _clean_stale_scratch(cache_dir: Path) -> None:
    """Remove scratch trees left by interrupted runs (only called under the lock)."""
    for stale in cache_dir.glob("scratch-*"):
        log(f"removing stale scratch dir {stale}")
        shutil.rmtree(stale, ignore_errors=True)


def _extract(tar: tarfile.TarFile, dest: Path) -> None:
    """Extract all of tar with the 'data' filter where this Python has it."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, filter="data")
    else:
        tar.extractall(dest)


def _build_log(cache_dir: Path) -> Path:
    """Return a fresh log file for the download and build steps."""
    logfile = cache_dir / "logs" / f"llama-build-{LLAMA_CPP_PYTHON_VERSION}.log"
    logfile.parent.mkdir(parents=True, exist_ok=True)
    logfile.write_text("")
    return logfile


def _download_sdist(scratch: Path, logfile: Path) -> Path:
    """Download the pinned llama-cpp-python sdist into scratch and return the tarball."""
    dl = scratch / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    req = f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
    log(f"downloading the {req} sdist (pip may prepare its metadata first: up to ~1 min)")
    t0 = time.monotonic()
    # Not --no-binary :all: (which would apply to the build deps pip installs to read the sdist's
    # metadata too, and without a usable system cmake it then compiles cmake from source).
    pip = [sys.executable, "-m", "pip", "download", "--no-binary", "llama-cpp-python", "--no-deps"]
    _run_logged([*pip, req, "-d", str(dl)], scratch, logfile)
    tarballs = sorted(dl.glob("llama_cpp_python-*.tar.gz"))
    if len(tarballs) != 1:
        raise RuntimeError(f"expected one llama_cpp_python sdist in {dl}, found {tarballs}")
    mib = tarballs[0].stat().st_size >> 20
    log(f"downloaded {tarballs[0].name} ({mib} MiB) in {time.monotonic() - t0:.0f}s")
    return tarballs[0]


def _install_vocab_from_tar(tarball: Path, cache_dir: Path) -> None:
    """Copy the vocab GGUF out of the sdist into the cache, atomically."""
    dest = vocab_path(cache_dir)
    if dest.is_file():
        return
    suffix = f"/vendor/llama.cpp/models/{dest.name}"
    with tarfile.open(tarball) as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith(suffix)), None)
        if member is None:
            raise RuntimeError(f"{dest.name} not found in {tarball}")
        src = tar.extractfile(member)
        assert src is not None
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        with src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out)
    os.replace(tmp, dest)
    log(f"cached vocab {dest}")


def ensure_vocab(cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """Return the cached vocab GGUF, extracting it from the sdist (without building) if missing."""
    dest = vocab_path(cache_dir)
    if dest.is_file():
        return dest
    with _cache_lock(cache_dir):
        if dest.is_file():
            return dest
        _clean_stale_scratch(cache_dir)
        scratch = cache_dir / f"scratch-vocab-{os.getpid()}"
        try:
            scratch.mkdir(parents=True)
            _install_vocab_from_tar(_download_sdist(scratch, _build_log(cache_dir)), cache_dir)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return dest


def _run_logged(cmd: list[str], cwd: Path, logfile: Path) -> None:
    """Run a build step into logfile, echoing progress to stderr; show the tail on failure."""
    log("$ " + " ".join(cmd))
    last_pct = ""
    with open(logfile, "a") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if line.startswith("[") and "%]" in line[:7]:
                pct = line[: line.index("%]") + 2]
                if pct != last_pct:
                    last_pct = pct
                    log(f"build {pct.strip('[] ')} {line[line.index('%]') + 3 :].strip()[:100]}")
        rc = proc.wait()
    if rc != 0:
        tail = logfile.read_text(errors="replace").splitlines()[-40:]
        raise RuntimeError(f"{cmd[0]} failed (rc={rc}); log {logfile}:\n" + "\n".join(tail))


def ensure_llama_server(cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """Return the cached llama-server binary, building it from the pinned sdist if not cached."""
    dest = server_path(cache_dir)
    if os.access(dest, os.X_OK):
        return dest
    with _cache_lock(cache_dir):
        if os.access(dest, os.X_OK):
            return dest
        _clean_stale_scratch(cache_dir)
        scratch = cache_dir / f"scratch-build-{os.getpid()}"
        t0 = time.monotonic()
        try:
            scratch.mkdir(parents=True)
            logfile = _build_log(cache_dir)
            tarball = _download_sdist(scratch, logfile)
            _install_vocab_from_tar(tarball, cache_dir)
            log("extracting sdist")
            with tarfile.open(tarball) as tar:
                _extract(tar, scratch / "src")
            tarball.unlink()
            roots = sorted((scratch / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
            if len(roots) != 1:
                raise RuntimeError(f"vendor/llama.cpp not found in sdist: {roots}")
            src = roots[0]
            build = scratch / "build"
            log(f"building llama-server (10-15 min on 2 cores); full log {logfile}")
            configure = ["cmake", "-S", str(src), "-B", str(build), *CMAKE_CONFIGURE_FLAGS]
            _run_logged(configure, scratch, logfile)
            jobs = str(os.cpu_count() or 1)
            _run_logged(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], scratch, logfile)
            built = build / "bin" / "llama-server"
            tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(built, tmp)
            os.chmod(tmp, 0o755)
            # Rename last: a half-copied binary must never look cached.
            os.replace(tmp, dest)
            log(f"cached {dest} (build took {time.monotonic() - t0:.0f}s)")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return dest


def llama_server_args(
    model: Path,
    port: int,
    ctx: int,
    parallel: int,
    *,
    host: str = "127.0.0.1",
    threads: int | None = None,
    alias: str | None = None,
) -> list[str]:
    """Return llama-server's flags (without argv[0]) for `parallel` slots of `ctx` tokens each."""
    # fmt: off
    args = [
        "-m", str(model),
        "--host", host,
        "--port", str(port),
        # -c is the total KV size, split evenly across slots (each rounded up to a multiple of 256).
        "-c", str(ctx * parallel),
        "-np", str(parallel),
        # Explicit: slots must not share one KV pool (the -np auto default turns --kv-unified on).
        "--no-kv-unified",
        "--metrics",
        "--slots",
        # --no-webui is a deprecated alias in this version.
        "--no-ui",
        # Skip device-memory fitting: on a CPU-only box it only adds start-up work.
        "--fit", "off",
    ]
    # fmt: on
    if threads is not None:
        args += ["-t", str(threads), "-tb", str(threads)]
    if alias is not None:
        args += ["--alias", alias]
    return args


@dataclass(frozen=True)
class Fit:
    """How the test world's resident fits itself to the simulated card, as llama.cpp's ``--fit`` does.

    Its claim on the VRAM ledger follows its context ``ctx`` (``-c``: every slot's KV cache)::

        claim(ctx) = weights + kv_per_token * ctx + margin

    With the defaults, 12 GiB + 1 MiB x 8192 + 1 GiB = 21 GiB at the world's ``-c 8192`` (two
    slots of 4096), the ledger's RESIDENT_VRAM. It starts with its full context only if
    ``claim(ctx) + target`` is free (``--fit-target``, 1 GiB); short of that it lowers ``-c`` by
    256 tokens per slot at a time until it fits, down to ``min_ctx`` (``--fit-ctx``), and fails as
    CUDA out of memory only when even ``claim(min_ctx)`` is not free. tests/stack/standins/llama_fit.py
    does it; a test opts in with ``enable_fit`` (the world's resident otherwise claims its fixed
    21 GiB or fails, so that the out-of-memory tests keep their meaning).
    """

    weights: int = 12 << 30
    kv_per_token: int = 1 << 20
    margin: int = 1 << 30
    target: int = 1 << 30
    min_ctx: int = 4096

    def claim(self, ctx: int) -> int:
        """Return what the resident holds with ``ctx`` tokens of context."""
        return self.weights + self.kv_per_token * ctx + self.margin


FIT_FILE = "strata.fit.json"  # in the world's control directory: present, strata fits itself at its next start


def enable_fit(control: Path, fit: Fit | None = None) -> Fit:
    """Make strata fit itself to the free memory from its next start on (until the file is removed)."""
    fit = fit or Fit()
    (control / FIT_FILE).write_text(json.dumps(asdict(fit)))
    return fit


def disable_fit(control: Path) -> None:
    """Make strata claim its fixed size again from its next start on."""
    (control / FIT_FILE).unlink(missing_ok=True)


def stop_server(proc: subprocess.Popen[Any], timeout: float = 10.0) -> int:
    """Stop a llama-server child: SIGTERM, then a second SIGTERM, then SIGKILL; return its rc."""
    # One SIGTERM is not always enough in this version: with a streamed request in flight the
    # server stops generating but waits for the client to hang up, and its signal handler can
    # deadlock on the task-queue mutex. A second SIGTERM makes it exit(1) at once.
    for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout if sig is signal.SIGTERM else None)
    return proc.wait()


def model_path(cache_dir: Path, kind: str = "tiny") -> Path:
    """Return where the cached model of `kind` lives; the name changes whenever its recipe does."""
    spec = MODEL_KINDS[kind]
    recipe = json.dumps([MODEL_FORMAT, LLAMA_CPP_PYTHON_VERSION, VOCAB_NAME, asdict(spec)], sort_keys=True)
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:10]
    return cache_dir / "models" / f"{kind}-{digest}.gguf"


def _write_model(dest: Path, spec: ModelSpec, vocab: Path) -> None:
    """Write a random-weight llama GGUF with the tokenizer of `vocab` to dest."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(vocab)
    tok_fields = {name: f for name, f in reader.fields.items() if name.startswith("tokenizer.")}
    token_types = np.asarray(tok_fields["tokenizer.ggml.token_type"].contents(), dtype=np.int32)
    n_vocab = len(token_types)

    writer = gguf.GGUFWriter(dest, arch="llama")
    writer.add_name(f"gpuswapd-test-{dest.stem}")
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head)
    writer.add_rope_dimension_count(spec.n_embd // spec.n_head)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if spec.f16 else gguf.LlamaFileType.ALL_F32)
    for name, field in tok_fields.items():
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    if "tokenizer.chat_template" not in tok_fields:
        writer.add_chat_template(CHATML_TEMPLATE)
    for key, token in FIM_TOKENS.items():
        if key not in tok_fields:
            writer.add_uint32(key, token)

    rng = np.random.default_rng(spec.seed)
    wdtype = np.float16 if spec.f16 else np.float32
    d, ff = spec.n_embd, spec.n_ff

    def mat(n_out: int, n_in: int, gain: float = 1.0) -> Any:
        """Random (n_out, n_in) matrix scaled so activations keep unit size."""
        return (rng.standard_normal((n_out, n_in), dtype=np.float32) * (gain / np.sqrt(n_in))).astype(wdtype)

    # Channel 0 of the residual stream is a constant "bias" channel: +bias for ordinary tokens,
    # -bias for control/unknown/byte tokens. The blocks never read it (norm weight 0) nor write it
    # (output rows 0), so with tied embeddings such a token's logit sits ~2*bias*out_gain (~100)
    # below the rest: EOS (and <s>, <unk>, raw bytes) are never sampled, max_tokens is reached.
    bias, out_gain = 4.0, 4.0
    emb = rng.standard_normal((n_vocab, d), dtype=np.float32)
    emb[:, 0] = np.where(token_types == int(gguf.TokenType.NORMAL), bias, -bias)
    writer.add_tensor("token_embd.weight", emb.astype(wdtype))
    out_norm = np.full(d, 2.0 / np.sqrt(d), dtype=np.float32)  # logits ~ N(0, 2): varied, not flat
    out_norm[0] = out_gain
    writer.add_tensor("output_norm.weight", out_norm)
    block_norm = np.ones(d, dtype=np.float32)
    block_norm[0] = 0.0
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", block_norm)
        writer.add_tensor(p + "attn_q.weight", mat(d, d))
        writer.add_tensor(p + "attn_k.weight", mat(d, d))
        writer.add_tensor(p + "attn_v.weight", mat(d, d))
        wo = mat(d, d, 0.5)
        wo[0] = 0
        writer.add_tensor(p + "attn_output.weight", wo)
        writer.add_tensor(p + "ffn_norm.weight", block_norm)
        writer.add_tensor(p + "ffn_gate.weight", mat(ff, d))
        writer.add_tensor(p + "ffn_up.weight", mat(ff, d))
        down = mat(d, ff, 0.5)
        down[0] = 0
        writer.add_tensor(p + "ffn_down.weight", down)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def ensure_model(cache_dir: Path = DEFAULT_CACHE_DIR, kind: str = "tiny") -> Path:
    """Return a cached random-weight llama GGUF of `kind` ('tiny' or 'slow'), writing it once."""
    if kind not in MODEL_KINDS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {sorted(MODEL_KINDS)}")
    dest = model_path(cache_dir, kind)
    if dest.is_file():
        return dest
    with _cache_lock(cache_dir):
        if dest.is_file():
            return dest
        vocab = ensure_vocab(cache_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        for old in [*dest.parent.glob(f"{kind}-*.gguf"), *dest.parent.glob(f".{kind}-*.tmp-*")]:
            old.unlink()
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        log(f"writing {kind} model {dest}")
        try:
            _write_model(tmp, MODEL_KINDS[kind], vocab)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        log(f"wrote {dest} ({dest.stat().st_size / 1e6:.1f} MB)")
    return dest


# ---------------------------------------------------------------------------------------------
# `check`: start the real server on each model and exercise the endpoints the tests rely on.
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 30.0) -> tuple[int, str]:
    """GET (or POST JSON) url; return (status, body text) even for HTTP errors."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _stream_chat(base: str, max_tokens: int, on_chunk: Any = None) -> list[dict[str, Any]]:
    """POST a streamed chat completion with usage and return all decoded SSE chunks."""
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story about a GPU."}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    chunks: list[dict[str, Any]] = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            chunks.append(chunk)
            if on_chunk is not None:
                on_chunk(chunk)
    return chunks


def _check_model(server: Path, model: Path, kind: str, log_dir: Path, threads: int | None) -> dict[str, Any]:
    """Run one llama-server on model, assert the endpoint contract, and return measurements."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    per_slot_ctx, parallel = 2048, 2
    cmd = [str(server), *llama_server_args(model, port, per_slot_ctx, parallel, threads=threads)]
    log_dir.mkdir(parents=True, exist_ok=True)
    logfile = log_dir / f"check-{kind}.log"
    log(f"[{kind}] $ {' '.join(cmd)}  (log {logfile})")
    result: dict[str, Any] = {"kind": kind, "model_mb": round(model.stat().st_size / 1e6, 1)}
    with open(logfile, "w") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            seen: list[int] = []
            first_503_body = None
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited rc={proc.returncode}; see {logfile}")
                try:
                    status, text = _http(base + "/health", timeout=2)
                except (urllib.error.URLError, ConnectionError, OSError):
                    status, text = 0, ""
                if not seen or seen[-1] != status:
                    seen.append(status)
                if status == 503 and first_503_body is None:
                    first_503_body = text
                if status == 200:
                    break
                if time.monotonic() - t0 > 120:
                    raise RuntimeError(f"not healthy after 120s; statuses {seen}")
                time.sleep(0.01)
            result["startup_to_healthy_s"] = round(time.monotonic() - t0, 3)
            result["health_statuses"] = seen
            result["health_503_body"] = first_503_body
            assert json.loads(text) == {"status": "ok"}, text

            status, text = _http(base + "/slots")
            assert status == 200, (status, text)
            slots = json.loads(text)
            assert len(slots) == parallel, slots
            for s in slots:
                assert {"id", "is_processing", "n_ctx"} <= s.keys(), s.keys()
                assert s["is_processing"] is False and s["n_ctx"] >= 2048, s
            result["slot_n_ctx"] = [s["n_ctx"] for s in slots]

            status, text = _http(base + "/metrics")
            assert status == 200 and "llamacpp:requests_processing" in text, (status, text[:500])

            chunks = _stream_chat(base, 16)
            last = chunks[-1]
            assert last["choices"] == [] and last["usage"]["completion_tokens"] == 16, last
            result["usage_chunk"] = last["usage"]

            # EOS must not cut completions short: max_tokens 16 should always yield 16 tokens.
            full = 0
            n_try = 10
            for i in range(n_try):
                status, text = _http(
                    base + "/v1/chat/completions",
                    {
                        "messages": [{"role": "user", "content": f"Say something #{i}"}],
                        "max_tokens": 16,
                    },
                )
                resp = json.loads(text)
                assert status == 200, text
                if resp["usage"]["completion_tokens"] == 16 and resp["choices"][0]["finish_reason"] == "length":
                    full += 1
            result["full_16_token_completions"] = f"{full}/{n_try}"
            assert full >= n_try - 1, result

            # Two concurrent streams, one per slot, both finish with usage.
            outs: list[list[dict[str, Any]]] = [[], []]
            workers = [threading.Thread(target=lambda k=k: outs[k].extend(_stream_chat(base, 32))) for k in range(2)]
            for w in workers:
                w.start()
            for w in workers:
                w.join(120)
            assert all(o and o[-1]["usage"]["completion_tokens"] == 32 for o in outs), outs

            # One long stream: measure speed and watch /slots and /metrics while it is in flight.
            n_long = 256
            busy_slots: list[bool] = []
            busy_metrics: list[str] = []
            first_token_at: list[float] = []
            stop = threading.Event()

            def poll() -> None:
                """Sample /slots and /metrics while the long stream runs."""
                while not stop.is_set():
                    _, t = _http(base + "/slots", timeout=5)
                    busy_slots.append(any(s["is_processing"] for s in json.loads(t)))
                    _, m = _http(base + "/metrics", timeout=5)
                    line = next(
                        (x for x in m.splitlines() if x.startswith("llamacpp:requests_processing")),
                        "",
                    )
                    busy_metrics.append(line)
                    time.sleep(0.2)

            def on_chunk(chunk: dict[str, Any]) -> None:
                """Note when the first content token arrives."""
                if not first_token_at and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    first_token_at.append(time.monotonic())

            poller = threading.Thread(target=poll)
            ts = time.monotonic()
            poller.start()
            try:
                chunks = _stream_chat(base, n_long, on_chunk)
            finally:
                stop.set()
                poller.join()
            te = time.monotonic()
            usage = chunks[-1]["usage"]
            assert usage["completion_tokens"] == n_long, usage
            timings = next((c["timings"] for c in reversed(chunks) if "timings" in c), None)
            result["long_stream_s"] = round(te - ts, 2)
            result["long_stream_tokens"] = usage["completion_tokens"]
            result["wall_tokens_per_s"] = round(n_long / (te - ts), 1)
            if first_token_at:
                result["time_to_first_token_s"] = round(first_token_at[0] - ts, 3)
            if timings:
                result["server_predicted_per_second"] = round(timings.get("predicted_per_second", 0.0), 1)
            result["slots_busy_samples"] = f"{sum(busy_slots)}/{len(busy_slots)}"
            result["metrics_busy_samples"] = sorted(set(busy_metrics))
            assert any(busy_slots), "no /slots sample showed is_processing: true during the long stream"
        finally:
            t_stop = time.monotonic()
            result["stop_rc"] = stop_server(proc)
            result["stop_s"] = round(time.monotonic() - t_stop, 2)
    log(f"[{kind}] ok: {json.dumps(result)}")
    return result


def check(cache_dir: Path, kinds: list[str], threads: int | None) -> list[dict[str, Any]]:
    """Start llama-server on each model kind and verify the endpoints the gpuswapd tests use."""
    server = ensure_llama_server(cache_dir)
    return [_check_model(server, ensure_model(cache_dir, k), k, cache_dir / "logs", threads) for k in kinds]


def main(argv: list[str] | None = None) -> int:
    """CLI: prepare the cached server/models, or check them against a live llama-server."""
    ap = argparse.ArgumentParser(prog="python -m tests.stack.llama", description=__doc__)
    ap.add_argument("what", choices=["server", "model", "all", "check"])
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE_DIR, help="cache dir (default %(default)s)")
    ap.add_argument("--kind", action="append", choices=sorted(MODEL_KINDS), help="model kind(s); default all")
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t for `check` (default %(default)s)")
    args = ap.parse_args(argv)
    kinds = args.kind or list(MODEL_KINDS)
    if args.what in ("server", "all"):
        print(ensure_llama_server(args.cache))
    if args.what in ("model", "all"):
        for k in kinds:
            print(ensure_model(args.cache, k))
    if args.what == "check":
        print(json.dumps(check(args.cache, kinds, args.threads), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
