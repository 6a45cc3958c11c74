"""gpuswapd-gateway: one OpenAI-compatible address for every model on the card.

A client of gpuswapd like any other: it routes each request by its ``model`` to the resident
(llama-swap, moved off :8080) or to the engine of the profile that serves that name, takes a
lease bound to its connection to open a window on demand, releases it ``idle`` after the last
request, and swaps back to the resident when a resident request comes while only its own lease
keeps the window. Layout:

    main.py      the console script: configuration, the listening socket (systemd's or its own), uvicorn
    app.py       the ASGI application: routes, bodies, OpenAI-shaped errors, SSE waiting comments
    demand.py    when a tenant may be served: the on-demand leases, the swap back, drains, preemptions
    follow.py    what gpuswapd says: the phase from ``watch``, refreshed from ``status``
    link.py      gpuswapd's socket, asynchronously, in the protocol of ``gpuswapd.protocol``
    tenants.py   which tenant serves which model name; the resident's names, remembered
    upstream.py  the upstream servers over httpx, streams passed through as they arrive
    meters.py    the gateway's Prometheus metrics
    errors.py    the gateway's errors, each with its HTTP status
"""
