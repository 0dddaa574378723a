"""Run modes that stay up: `driverd daemon` (host, systemd Type=notify) and `driverd container-entrypoint`
(the driver container). A reconcile loop compares the desired state (the configuration) with the
host's facts and applies the plan through the node transaction path (driverd.apply.lifecycle), on a
timer and when the configuration changes; it reports over sd_notify and HTTP (/metrics, /healthz,
/readyz) and retries failures with a capped backoff instead of exiting.

Modules: notify (sd_notify), configwatch (config file changes), backoff, drift (module parameters
that differ from the configuration), fingerprint (what was converged), reconcile (one pass),
health (readiness), metrics (Prometheus; the only importer of prometheus_client), endpoints (HTTP),
entrypoint (the container's fast path), loop (signals, timers, the worker thread).
"""
