"""vLLM engines in ``spawn``ed processes, driven over a pipe, and a radixkv manager process:
the harness of ``tests/vllm`` (imports vLLM only in the engine
processes).

An engine process builds one ``vllm.LLM`` (engine core and worker in that process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor ``uni``) and then answers commands:
``generate`` (greedy, prompts as token ids) -> ``[(output token ids, num_cached_tokens)]``
(``timed=True``: one prompt at a time, each with its wall seconds) and ``metrics`` -> vLLM's
prefix-cache counters. Start-up costs about a minute of CPU, so start engines once and in
parallel.
"""
import os
import signal
import subprocess
import sys
import time
import traceback
from multiprocessing import get_context

from process_group import end_group, lead_group

ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}


def _engine_main(conn, kwargs, env):
    lead_group()  # vLLM's own children go with this process when the harness stops it
    os.environ.update(env)
    try:
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig
        from vllm.inputs import TokensPrompt

        ktc = kwargs.pop("kv_transfer_config", None)
        if ktc is not None:
            kwargs["kv_transfer_config"] = KVTransferConfig(**ktc)
        llm = LLM(**kwargs)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "stop":
                break
            if cmd == "generate":
                prompts, max_tokens, timed, salt, logprobs = args
                sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                    logprobs=0 if logprobs else None)
                batches = [[p] for p in prompts] if timed else [prompts]
                salted = {"cache_salt": salt} if salt else {}
                res = []
                for batch in batches:
                    t0 = time.perf_counter()
                    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p), **salted) for p in batch], sp,
                                        use_tqdm=False)
                    dt = time.perf_counter() - t0
                    res += [(list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0),
                             [d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [],
                                                          strict=False)] if logprobs else dt) for o in outs]
                conn.send(("ok", res if timed or logprobs else [r[:2] for r in res]))
            elif cmd == "metrics":
                conn.send(("ok", {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                                  if "prefix_cache" in m.name}))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    conn.close()
    os._exit(0)  # vLLM's exit hooks take tens of seconds and free nothing the OS does not


class EngineProcess:
    """One vLLM engine in a spawned process (``start`` returns at once; ``wait_ready``)."""

    def __init__(self, name, llm_kwargs, env=None):
        ctx = get_context("spawn")
        self.name = name
        self.kwargs = dict(llm_kwargs)
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_main, args=(child, dict(llm_kwargs), {**ENGINE_ENV, **(env or {})}),
                                name=f"vllm-{name}", daemon=False)
        self.proc.start()
        child.close()

    def _reply(self, timeout_s):
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"engine {self.name}: no answer in {timeout_s} s")
        kind, value = self._conn.recv()
        if kind == "error":
            raise RuntimeError(f"engine {self.name} failed:\n{value}")
        return value

    def wait_ready(self, timeout_s=900):
        self._reply(timeout_s)

    def generate(self, prompts, max_tokens=16, timeout_s=300, timed=False, salt=None, logprobs=False):
        """``[(tokens, num_cached_tokens)]`` (``timed``: ``[(tokens, cached, seconds)]``, one
        prompt at a time; ``logprobs``: ``[(tokens, cached, each token's logprob)]``; ``salt``:
        vLLM's ``cache_salt``, a cache namespace of its own)."""
        self._conn.send(("generate", [list(map(int, p)) for p in prompts], max_tokens, timed, salt, logprobs))
        return self._reply(timeout_s)

    def metrics(self):
        self._conn.send(("metrics",))
        return self._reply(60)

    def stop(self):
        if self.proc.is_alive():
            try:
                self._conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        if self.proc.pid is not None:  # None: it never started, so it leads no group
            end_group(self.proc.pid)


class ManagerProcess:
    """``radixkv serve`` as a subprocess on a Unix socket (``start`` / ``kill`` / ``stop``)."""

    def __init__(self, address, token_file, shm_dir, args):
        """``args``: more ``radixkv serve`` flags (``--model-config``, ``--page-size``, ...)."""
        self.cmd = [sys.executable, "-m", "radixkv", "serve", "--address", address, "--token-file", token_file,
                    "--shm-dir", shm_dir, "--log-level", "WARNING", *args]
        self.address = address
        self.token_file = token_file
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s=120):
        self.proc = subprocess.Popen(self.cmd)
        import radixkv

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                radixkv.connect(self.address, token_file=self.token_file, wait_s=2.0).close()
                return
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"manager did not start (exit {self.proc.poll()})") from None
                time.sleep(0.2)

    def client(self):
        import radixkv

        return radixkv.connect(self.address, token_file=self.token_file, wait_s=10.0)

    def kill(self):
        if self.proc is None:
            raise RuntimeError("the manager was never started")
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
