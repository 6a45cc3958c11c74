"""Write the key reference of gpuswapd.toml(5) from gpuswapd/config.py.

Names, types, ranges and defaults are read from the config dataclasses; only the meaning of each
key is written here. The page keeps the output between its ``BEGIN KEYS``/``END KEYS`` lines:

    python packaging/man/config_keys.py            # print the generated part
    python packaging/man/config_keys.py --write    # update packaging/man/gpuswapd.toml.5

tests/packaging/test_packaging.py fails when the page differs from what this script writes, or when a
key has no meaning here.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PAGE = Path(__file__).resolve().parent / "gpuswapd.toml.5"
BEGIN = '.\\" BEGIN KEYS: written by packaging/man/config_keys.py --write from gpuswapd/config.py'
END = '.\\" END KEYS'

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gpuswapd import config  # noqa: E402
from gpuswapd.timespan import format_span  # noqa: E402

_VERIFY = {
    "url": "The chat completions endpoint (OpenAI API) that must answer.",
    "model": "The model name sent with the request.",
    "prompt": "The prompt of the verifying request; the answer must be a real completion.",
    "max_tokens": "The request's max_tokens: leave headroom, a thinking model spends tokens before it answers.",
    "timeout": "How long the verifying completion may take, retries included.",
}

MEANINGS: dict[str, str] = {
    "daemon.socket": "The Unix socket gpuswapd creates (group socket_group; mode 0666 while status_public is true, "
                     "else 0660) when systemd does not hand it one. Ignored under socket activation: "
                     "gpuswapd.socket's ListenStream= and SocketMode= name the socket then.",
    "daemon.socket_group": "Members of this group (and root) may acquire, renew and release leases, run commands "
                           "under a lease and ask for a plan. Under socket activation the socket unit's "
                           "SocketGroup= sets the group of the socket file; this key still decides who is allowed. "
                           "Empty: root only.",
    "daemon.state_dir": "An absolute path: the state document (state.json, with its previous copy state.prev.json, "
                        "written before every phase change and every change to the system) and the finished "
                        "windows (history.jsonl).",
    "daemon.default_lease": "The length of a lease when acquire has no --for.",
    "daemon.max_lease": "The longest lease: longer requests are capped to it. At least default_lease.",
    "daemon.linger": "How long the window stays open after its last lease ended, so that back-to-back jobs do not "
                     "swap the GPU back and forth.",
    "daemon.on_shutdown": "What gpuswapd does with an open window when it is stopped (SIGTERM): \"restore\" closes "
                          "it and gives the GPU back to the resident first; \"keep\" leaves it as it is, for the "
                          "next gpuswapd to adopt.",
    "daemon.status_public": "Whether every local user may read status and history (never acquire, renew or "
                            "release). When true the socket is made world-connectable (0666; the shipped "
                            "gpuswapd.socket has SocketMode=0666 to match) and gpuswapd checks each caller's "
                            "credentials itself; set it to false and SocketMode=0660 to keep other users out.",
    "daemon.call_timeout": "How long one call to systemd (D-Bus), Docker or the state directory may take. A call that "
                           "outlives it fails the step that made it (opening rolls back; closing retries) and counts "
                           "as hung until it returns: status lists it, and the window waits for it to land before "
                           "its record is cleared. Each system has workers of its own, so one that hangs never "
                           "starves the others. Start and stop jobs are bounded by resident.start_timeout and "
                           "stop_timeout instead; the engine's stop by window.container.stop_timeout on top.",
    "daemon.max_clients": "How many connections gpuswapd serves at once. A client beyond the limit gets a one-line "
                          "refusal and is disconnected; gpuswapd never runs out of file descriptors (it raises its "
                          "soft RLIMIT_NOFILE to fit, or refuses to start, exit 78, if LimitNOFILE= is too low).",
    "daemon.max_clients_per_uid": "How many connections one non-root user may hold open at once.",
    "daemon.reserved_clients": "Of max_clients, how many only root and members of socket_group may use: a flood "
                               "from other users leaves the operator's gpuswapctl an answer.",
    "daemon.max_queue": "How many requests may wait in the queue for a window of another profile (or behind a "
                        "fair claim). One more is refused at once: gpuswapctl exits 4, \"queue full\".",
    "daemon.fair_after": "Fairness: once a queued request for another profile has waited this long, new requests "
                         "for the open window's profile queue behind it instead of joining, so the open window "
                         "closes when its current leases end and the waiting profile gets the card. While such a "
                         "request waits, a renewal may extend a lease only up to the moment it has waited this "
                         "long (and never shortens one): after that, renewals keep the expiry already granted "
                         "(\"capped\": \"fair_after\", see gpuswapctl(1)).",
    "daemon.residency_factor": "The schedule's share: a request for another profile waits for the card at most "
                               "max(fair_after, min(residency_max, residency_factor x price)), where price is what "
                               "the swaps it costs took in history (the open window's close and its own open, and "
                               "back again: gpuswapctl status shows each profile's price). The larger, the fewer "
                               "swaps and the longer waits: at most about 1/(1 + factor) of the card's time goes "
                               "to swapping while two profiles contend. 0: fair_after alone.",
    "daemon.residency_max": "The longest share the price may buy the tenant on the card while a request for another "
                            "profile waits (fair_after, if longer, still holds).",
    "daemon.reclaim_grace": "After a restart of gpuswapd, how long a client may reclaim with its token (the "
                            "\"accepted\" event of its acquire) the lease bound to its connection, or its place in "
                            "the queue; an unreclaimed lease then ends. gpuswapctl acquire and run reclaim by "
                            "themselves; 0: a restart ends the leases bound to connections, as before.",
    "daemon.abandon_grace": "A window whose last waiting client hung up while it opened goes on opening this long, "
                            "so that a retry (a client with a short timeout) rejoins it; then it is rolled back. "
                            "0: rolled back at once.",
    "daemon.priority_max_nonroot": "The highest --priority a caller other than root may ask for; above it the "
                                   "request is refused (gpuswapctl exits 4) and the message says the limit.",
    "daemon.priority_min_nonroot": "The lowest --priority a caller other than root may ask for; below it the "
                                   "request is refused (gpuswapctl exits 4). A very negative priority would only "
                                   "invite preemption by anyone, and keeps the queue's order hard to read.",
    "daemon.aging": "A queued request gains one level of effective priority per this much waiting, so none starves "
                    "(0: no aging). Aging orders the queue only; preemption looks at the base priority.",
    "daemon.preempt_grace": "How long the holders of a preempted window have between the notice (the preempting "
                            "event; gpuswapctl run sends its command SIGTERM) and the revoking of their leases.",
    "daemon.never_stop": "Units (glob patterns) a preemption never stops: their leases are only revoked. Other leases "
                         "bound to a unit have that unit stopped through systemd when they are revoked, so its "
                         "ExecStopPost= runs as usual. The defaults are gpuswapd's own units (the gateway's too) and "
                         "the services that run the work of many users (cron, atd, sshd, slurmd, systemd's own): a "
                         "lease is bound to a unit only when the unit is the caller's own (see gpuswapctl(1), \"Who "
                         "may ask\" in the docs), and this list keeps those services running whatever a lease says. "
                         "Setting the key replaces the whole list: keep the defaults in it.",
    "daemon.reconcile": "How often an idle gpuswapd (no window, no queue) looks at the resident (0: never). "
                        "gpuswapd starts a unit or timer only to undo its own stop: a configured resident unit "
                        "found down for another reason (stopped, failed, in its start limit, masked) is reported in status "
                        "(resident_down), the gpuswapd_resident_down gauge and a resident_down event, never "
                        "started (see resident.restart_crashed). A resident its operator restarted since "
                        "gpuswapd last saw it (a new InvocationID) is taken as the resident's new baseline.",
    "gpu.probe": "How free VRAM is read: \"nvml\" (the NVIDIA Management Library, nvidia-ml-py), \"nvidia-smi\" "
                 "(runs nvidia_smi), or \"none\" (no VRAM checks: the windows then rely on the units' stop alone).",
    "gpu.index": "The GPU, as nvidia-smi -i and NVML number them.",
    "gpu.window_needs": "The free VRAM required before the window's container starts.",
    "gpu.resident_needs": "The free VRAM required before the resident units start again (and beside a parked "
                          "engine). When the resident's processes are seen to hold more (read from the GPU probe "
                          "before a window stops it, and at its baseline), gpuswapd warns once "
                          "(resident_footprint_larger) and counts that instead, for every later check.",
    "gpu.release_timeout": "How long VRAM may take to come free after a stop (it lags the processes' exit). On "
                           "timeout the error names the processes that hold VRAM and their units.",
    "gpu.nvidia_smi": "The nvidia-smi command (looked up in PATH, or an absolute path) for probe = \"nvidia-smi\".",
    "gpu.probe_timeout": "How long one VRAM reading may take. A probe that hangs (a stuck driver) fails the window "
                         "with a clear error within this time; status then lists the hung call.",
    "resident.units": "The units that hold the GPU normally. The active units that Requires=, BindsTo= or PartOf= "
                      "them are found over D-Bus, recorded and stopped as well (dependents first), and exactly "
                      "those are started again.",
    "resident.stop_timeout": "How long stopping one unit may take.",
    "resident.start_timeout": "How long starting one unit may take. It also bounds a prefetch of the resident's "
                              "files (a read that takes longer is of no help to a start).",
    "resident.files": "The resident's model files (absolute paths), read back into the page cache while a window "
                      "closes, so that the resident loads them from RAM. Empty: gpuswapd finds them in what the "
                      "resident's units run (ExecStart= over D-Bus: llama-server's -m/--model, --mmproj, "
                      "-md/--model-draft, also inside a wrapper's or a shell's command line; Environment= "
                      "LLAMA_ARG_MODEL, LLAMA_ARG_MMPROJ, LLAMA_ARG_MODEL_DRAFT). A model llama.cpp downloads "
                      "itself (-hf) has no path to find: name it here. gpuswapctl plan lists the files with the "
                      "fraction of each in the page cache.",
    "resident.restart_crashed": "Whether the idle reconcile (daemon.reconcile) starts a resident unit found failed. "
                                "gpuswapd otherwise starts a unit or timer only to undo its own stop: a unit down "
                                "for another reason (crashed, stopped, masked or disabled by its operator) is reported "
                                "(status, the gpuswapd_resident_down gauge, a resident_down event), never started; "
                                "restarting a crashed service is Restart='s job. Even on, a masked or disabled unit "
                                "is never started, nor one in its start limit (systemd refuses it until "
                                "systemctl reset-failed), a dependent or a timer.",
    "resident.prefetch": "Whether a close that restores the resident reads its files into the page cache in the "
                         "background, from the start of the close, while the engine stops or sleeps and the VRAM "
                         "comes free. Nothing waits for it and it ends with the close; it is skipped (and logged) "
                         "when the host's MemAvailable, less what a level-1 park keeps in host RAM "
                         "(window.park.host_ram_needs, else the window's VRAM), cannot hold the files. A switch to "
                         "another profile and a preemption do not restore the resident and read nothing.",
    "resident.cache.keep": "Whether llama.cpp's slots (the KV caches of the agents' contexts) are kept across a "
                           "window: saved by llama-server (POST /slots/ID?action=save) in STOPPING_RESIDENT, once "
                           "the timers are paused and the resident drained, before it stops; restored in RESTORING, "
                           "after the verify and before the timers resume, and only into the resident that saved "
                           "them (the model file's path, size, mtime and inode, the context per slot and the slot "
                           "count). \"auto\": where llama-server has --slot-save-path (or save_path is set) and "
                           "server = \"llama.cpp\"; \"on\": the same, warning when there is no save path; \"off\": "
                           "never. A save or restore that fails or is slow is skipped with a warning: the resident "
                           "comes back cold, never DEGRADED. The window's record says what was saved and restored "
                           "(cache: slots, tokens, bytes, seconds); gpuswapd_resident_prefill_tokens_saved_total "
                           "counts the tokens restored. The files are gpuswapd's to remove (once restored or "
                           "skipped, at the window's end, or stale before the next save): the directory must be "
                           "writable by gpuswapd's group (the shipped /var/cache/gpuswapd/slots, 2770 root:gpuswap, "
                           "with the resident's user in group gpuswap).",
    "resident.cache.save_path": "llama-server's --slot-save-path. Empty: read from the resident's units' "
                                "ExecStart= (also inside a wrapper's or a shell's command line; llama.cpp has no "
                                "environment variable for it).",
    "resident.cache.slots_url": "llama-server's own GET /slots and POST /slots/ID, never through llama-swap or the "
                                "gateway. Empty: props_url with /slots for /props.",
    "resident.cache.save_timeout": "What the save may add to the opening, all slots together (and the restore to "
                                   "the close). A save or restore that takes longer is given up and skipped with a "
                                   "warning.",
    "resident.cache.max_size": "The most the slot files of one window may take together. Slots beyond it, or "
                               "beyond the free room of the save directory's disk, are not saved (largest first; "
                               "each skipped one is named in the record and the log).",
    "resident.server": "What the resident is. \"llama.cpp\": a llama-server, whose context per slot "
                       "(default_generation_settings.n_ctx), total_slots, model_path and alias are read from "
                       "props_url; \"other\": any OpenAI server, known by its model ids only. Either way the ids of "
                       "GET /v1/models on the base of verify.url are read too. They are recorded as the resident's "
                       "baseline at start and after every restore that finds it as it was, and compared after every "
                       "restore's verify: a smaller context, fewer slots or a model gone (llama.cpp's --fit shrinks "
                       "its context when memory is short, silently) makes gpuswapd remove a parked engine, restart "
                       "the resident once it has the room it had, and compare again; still smaller, the window "
                       "ends \"restored, smaller\" (status and history say what changed and what holds the "
                       "memory, gpuswapd_resident_degraded is 1, the next close tries again).",
    "resident.props_url": "For server = \"llama.cpp\" (required then): the llama-server's own GET /props, not "
                          "through a proxy or the gateway, e.g. \"http://127.0.0.1:8081/props\"; when llama-swap "
                          "starts the server itself (its cmd), llama-swap passes it on unchanged at "
                          "/upstream/MODEL/props.",
    "resident.idle.kind": "How to tell whether a request is in flight on the resident: \"llama.cpp-slots\" (GET url, "
                          "busy while any slot is_processing), \"prometheus\" (GET url, busy while metric > 0), "
                          "\"command\" (run command, idle when it exits 0), \"gateway\" (ask gpuswapd-gateway at "
                          "gateway.listen how many resident requests pass through it now; while the window drains, "
                          "the gateway holds new ones) or \"none\" (never busy).",
    "resident.idle.url": "The URL that kind = \"llama.cpp-slots\" or \"prometheus\" reads. With a [gateway] table it "
                         "must not be on gateway.listen: the probes bypass the gateway.",
    "resident.idle.metric": "The gauge that kind = \"prometheus\" reads.",
    "resident.idle.command": "The command (argument list, no shell) that kind = \"command\" runs; required then. It "
                             "runs as gpuswapd does, inside the sandbox of gpuswapd.service.",
    "resident.idle.wait": "How long to wait for in-flight work to end before on_busy applies.",
    "resident.idle.on_busy": "What a window does when the resident is still busy after wait: \"fail\" the acquire, "
                             "or \"proceed\" anyway.",
    **{f"resident.verify.{k}": v + (" It proves the resident is back before the timers resume."
                                    if k == "url" else "") for k, v in _VERIFY.items()},
    "timers.pause": "Glob patterns of timer units. The matching timers that are active when a window opens are "
                    "recorded and stopped, and exactly those are started again after the resident is back.",
    "timers.wait_for_jobs": "How long the services of those timers that are running when a window opens may take "
                            "to finish.",
    "window.health_url": "The engine's health endpoint, polled until it answers 200.",
    "window.serves": "The model names that open this profile's window on demand through gpuswapd-gateway(8) "
                     "([window] for the profile \"default\", [profiles.NAME] for the others). A name two profiles "
                     "serve, or a profile and resident.verify.model, is refused naming both.",
    "window.api": "The engine's OpenAI base URL, to which the gateway sends this profile's requests "
                  "(\"http://HOST:PORT\", a trailing /v1 is taken off). Empty: the scheme, host and port of "
                  "verify.url.",
    "window.boot_timeout": "How long the engine may take to become healthy (a cold vLLM compiles kernels first).",
    "window.watch_interval": "How often the engine's health is probed while the window is READY.",
    "window.max_restarts": "How many times per window a failed engine is restarted before the window closes and the "
                           "GPU goes back to the resident.",
    "window.container.name": "The container's name.",
    "window.container.image": "The image. With create = true it must be in Docker already: gpuswapd checks at "
                              "start, and exits with status 78 if it is not.",
    "window.container.create": "true: create the container from this table for each window and remove it when the "
                               "window closes; false: start and stop an existing container of that name.",
    "window.container.env_file": "A file of KEY=VALUE lines in Docker's --env-file format, read by gpuswapd (as "
                                 "root, without capabilities) when it creates the container. Empty: none.",
    "window.container.env": "Environment variables, over those of env_file.",
    "window.container.ports": "Published ports: container port (\"8000/tcp\") = host port. Unused with "
                              "network_mode = \"host\".",
    "window.container.volumes": "Bind mounts: host path = container path, with Docker's options "
                                "(\"/models:ro\").",
    "window.container.network_mode": "Docker's network mode: \"\" for Docker's default network with the ports "
                                     "above, \"host\" for the host's network.",
    "window.container.gpus": "The GPU device request: \"all\", a list of device indexes, or [] for none.",
    "window.container.shm_size": "The size of /dev/shm in Docker's notation (\"16g\"). Empty: Docker's default.",
    "window.container.command": "The command, replacing the image's. Empty: the image's own.",
    "window.container.stop_timeout": "How long the container may take to stop before Docker kills it.",
    "window.park.mode": "What happens to the engine when a window closes: \"stop\" removes it; \"sleep\" puts "
                        "it to sleep (vLLM's sleep mode) and parks it, if the card then has gpu.resident_needs free, "
                        "so that the next window wakes it in seconds. Sleep needs vLLM started with "
                        "--enable-sleep-mode and VLLM_SERVER_DEV_MODE=1; without them gpuswapd logs why and removes "
                        "the engine as with \"stop\". Needs a GPU probe.",
    "window.park.level": "vLLM's sleep level: 1 offloads the weights to host RAM (the fastest wake), 2 drops them "
                         "(a slower wake that reloads them).",
    "window.park.keep": "A parked engine unused this long is removed (the resident is not touched). It holds across "
                        "restarts of gpuswapd.",
    "window.park.host_ram_needs": "Sleep at level 1 only if at least this much host memory is available "
                                  "(MemAvailable); otherwise sleep at level 2. 0: do not check.",
    "window.park.settle": "How long, once the engine says it sleeps, gpuswapd waits for what comes next "
                          "(gpu.resident_needs, or the next window of a direct switch) to come free beside it: "
                          "the card frees a sleeping engine's memory some time after, as it does an exited "
                          "process's (0.1 to 1.5 s on real cards); not when the resident's units are up "
                          "already (it runs beside the engine). Then the engine is parked, or removed with the "
                          "numbers in the log (engine_not_parked: free, need, waited_s, settle_s).",
    "window.warmup.requests": "How many streamed completions warm a cold engine before the window counts as ready.",
    "window.warmup.prompt": "The prompt of the warmup completions.",
    "window.warmup.max_tokens": "The max_tokens of the warmup completions.",
    **{f"window.verify.{k}": v + (" It proves the engine serves before the window is READY."
                                  if k == "url" else "") for k, v in _VERIFY.items()},
    # The known-bad table (KNOWN-BAD SETTINGS below).
    "window.allow_known_bad": "The ids of the known-bad rows (KNOWN-BAD SETTINGS) that this engine may match: "
                              "such a row neither warns nor refuses for this profile, and gpuswapd logs at start "
                              "that it is allowed (known_bad_allowed). An id no row has is a warning. Each engine "
                              "profile has its own list; none is inherited from [window].",
    "metrics.listen": "host:port on which gpuswapd serves GET /metrics (Prometheus's text format) from its own "
                      "event loop, within the socket's connection caps and timeouts, e.g. \"127.0.0.1:9477\". "
                      "Port 0 is refused; a port that cannot be had stops the start (exit 78). Empty: off.",
    "metrics.textfile": "An absolute path ending in .prom: gpuswapd writes the metrics there for node_exporter's "
                        "textfile collector, through a temporary name in the same directory that does not end in "
                        ".prom, renamed over the file, mode 0644, at most once a second. The directory must exist and "
                        "be writable by gpuswapd (exit 78 otherwise): under ProtectSystem=strict that takes a "
                        "ReadWritePaths= drop-in (/usr/share/doc/gpuswapd/examples/metrics-textfile.conf), and root "
                        "without CAP_DAC_OVERRIDE must be allowed to write there by the directory's mode. Empty: off.",
    "hooks.command": "A command (argument list, no shell; the first an absolute path to an executable file, checked "
                     "at start) run once for each event named in events, with the event's JSON on standard input. "
                     "At most four run at once (beyond that an event is dropped and counted in "
                     "gpuswapd_hook_events_dropped_total); a hook never holds up the window. It runs inside "
                     "gpuswapd.service's sandbox. /usr/share/doc/gpuswapd/examples/gpuswap-notify posts to an "
                     "ntfy-style URL. Empty: no hooks.",
    "hooks.events": "The events that run the hook, by their log names (see gpuswapd(8), EVENTS, METRICS AND HOOKS): "
                    "e.g. window_failed, degraded, recovered, engine_restarted, engine_failed, phase_entered, "
                    "lease_expired, window_finished, preempted. A name gpuswapd does not know stops the start "
                    "(exit 78).",
    "hooks.timeout": "A hook still running after this long is killed with its process group; that is logged "
                     "(hook_timed_out), and nothing else happens.",
    "gateway.listen": "host:port of gpuswapd-gateway(8), the one OpenAI-compatible address of every model. Ignored "
                      "under socket activation (gpuswapd-gateway.socket's ListenStream= says where then); it is also "
                      "where resident.idle.kind = \"gateway\" asks, and the address resident.verify.url and "
                      "resident.idle.url must not use.",
    "gateway.resident": "The base URL of the resident's models: llama-swap, moved off 8080 (e.g. "
                        "\"http://127.0.0.1:8090\"). Its GET /v1/models names the resident's models.",
    "gateway.idle": "An on-demand window is released this long after its last request through the gateway ended.",
    "gateway.hold": "The longest a request waits for its model's window to open (or for the resident to serve "
                    "again); then 503, or an SSE error event once its stream has started.",
    "gateway.on_resident_busy": "A resident request while other holders keep a window: \"wait\" (up to hold) or "
                                "\"fail\" (503 with Retry-After, naming who holds the card and until when). Either "
                                "way, a window kept only by the gateway's own idle lease is released at once.",
    "gateway.priority": "The priority of the gateway's on-demand leases (above daemon.priority_max_nonroot only if "
                        "gpuswapd-gateway runs as root).",
    "gateway.max_body": "A request body larger than this gets 413.",
    "gateway.max_bodies": "The request bodies the gateway holds in memory at once (read, waiting for a window, "
                          "being sent), all together, each counted twice (its pieces as they come, and the body they are "
                          "joined into): a body that would go past it gets 503 with Retry-After, so that waiting "
                          "requests cannot exhaust the gateway's memory.",
    "gateway.upstream_idle": "An upstream answer that sends nothing for this long (between two pieces, or before "
                             "the first piece once its headers came) is ended: a stream with an error event, any "
                             "other answer cut short. The wait for the headers (a non-streamed completion's whole "
                             "generation) is bounded by 10 minutes.",
    "gateway.max_waiting": "How many requests may wait for a window at once; beyond that 429.",
    "gateway.loading_state": "A streamed chat request that waits for its window gets the window's progress as "
                             "reasoning text (reasoning_content chunks, as llama-swap's sendLoadingState), not SSE "
                             "comments: for clients that show nothing of comments.",
}

_TYPES: dict[str, Callable[[dict[str, Any]], str]] = {
    "_string": lambda c: "string",
    "_nonempty": lambda c: "string, not empty",
    "_url": lambda c: "http(s) URL",
    "_optional_url": lambda c: "http(s) URL, or empty",
    "_span": lambda c: "time span" + (f", at least {format_span(c['minimum'])}" if c["minimum"] else ""),
    "_size": lambda c: "size",
    "_int": lambda c: f"integer, {c['minimum']} to {c['maximum']}",
    "_number": lambda c: f"number, {c['minimum']:g} to {c['maximum']:g}",
    "_bool": lambda c: "boolean",
    "_choice": lambda c: "one of " + ", ".join(json.dumps(v) for v in c["choices"]),
    "_strings": lambda c: "list of strings",
    "_units": lambda c: "list of unit names, at least one",
    "_timer_patterns": lambda c: "list of glob patterns ending in .timer",
    "_unit_patterns": lambda c: "list of unit names or glob patterns",
    "_string_map": lambda c: "table of strings",
    "_ports": lambda c: "table of port numbers",
    "_gpus": lambda c: "\"all\" or a list of integers",
    "_docker_size": lambda c: "string, a Docker size",
    "_listen": lambda c: "host:port, or empty",
    "_abs_path": lambda c: "absolute path, or empty",
    "_abs_paths": lambda c: "list of absolute paths",
    "_command": lambda c: "list of strings, the first an absolute path",
    "_event_names": lambda c: "list of event names",
    "_model_names": lambda c: "list of model names",
    "_base_url": lambda c: "http(s) base URL",
    "_api_url": lambda c: "http(s) base URL, or empty",
}


def all_keys(cls: type[Any] = config.Config, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field[Any]]]:
    """Yield every key's dotted name and field, in the order of the dataclasses."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in ("source", "profiles", "gateway_configured"):
            continue
        if "parse" in f.metadata:
            yield prefix + f.name, f
        else:
            yield from all_keys(hints[f.name], f"{prefix}{f.name}.")


def sections(cls: type[Any] = config.Config, prefix: str = "") -> Iterator[str]:
    """Yield the dotted name of every TOML table, in order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in ("source", "profiles", "gateway_configured") and "parse" not in f.metadata:
            yield prefix + f.name
            yield from sections(hints[f.name], f"{prefix}{f.name}.")


def _parser(f: dataclasses.Field[Any]) -> tuple[str, dict[str, Any]]:
    parse = f.metadata["parse"]
    name = parse.__qualname__.split(".")[0]
    cells = dict(zip(parse.__code__.co_freevars, (c.cell_contents for c in parse.__closure__ or ()), strict=True))
    return name, cells


def _type(f: dataclasses.Field[Any]) -> str:
    name, cells = _parser(f)
    if name not in _TYPES:
        raise KeyError(f"config_keys.py does not know the parser {name} yet: add it to _TYPES")
    return _TYPES[name](cells)


def _iec(nbytes: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)


def _default(f: dataclasses.Field[Any]) -> str | None:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return None
    kind = _parser(f)[0]
    if kind == "_span":
        return json.dumps(format_span(value))
    if kind == "_size":
        return json.dumps(_iec(value))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        pairs = ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in value.items())
        return f"{{ {pairs} }}" if pairs else "{}"
    return json.dumps(value)


def _roff(text: str) -> str:
    """Escape text for a man page line: backslashes, minus signs, a leading control character."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\\&" + text if text[:1] in (".", "'") else text


def generate() -> str:
    """Return the roff of the key reference."""
    missing = [k for k, _ in all_keys() if k not in MEANINGS]
    if missing:
        raise KeyError(f"no meaning written for {', '.join(missing)}: add them to MEANINGS in config_keys.py")
    by_section: dict[str, list[tuple[str, dataclasses.Field[Any]]]] = {}
    for dotted, f in all_keys():
        by_section.setdefault(dotted.rpartition(".")[0], []).append((dotted, f))
    out: list[str] = []
    for section in sections():
        out.append(f'.SS "[{_roff(section)}]"')
        for dotted, f in by_section.get(section, []):
            name = dotted.rpartition(".")[2]
            default = _default(f)
            said = "required" if default is None else f"default \\fB{_roff(default)}\\fR"
            out += [".TP", f"\\fB{_roff(name)}\\fR (\\fI{_roff(_type(f))}\\fR; {said})", _roff(MEANINGS[dotted])]
    return "\n".join(out) + "\n"


def render_page(page: str) -> str:
    """Return ``page`` with its generated part replaced by a fresh one."""
    head, begin, rest = page.partition(BEGIN + "\n")
    _, end, tail = rest.partition(END + "\n")
    if not begin or not end:
        raise ValueError(f"{PAGE.name} lacks the lines {BEGIN!r} and {END!r}")
    return head + begin + generate() + end + tail


def main(argv: list[str]) -> int:
    """Print the key reference, or write it into gpuswapd.toml(5) with --write."""
    if argv[1:] == ["--write"]:
        PAGE.write_text(render_page(PAGE.read_text()))
        return 0
    if argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    sys.stdout.write(generate())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
