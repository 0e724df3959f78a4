"""The gateway's HTTP API: one router per surface over one :class:`handler.GatewayHandler`.

``completions`` (``POST /v1/completions``), ``chat`` (``POST /v1/chat/completions``), ``feedback``
(``POST /v1/feedback``) and ``ops`` (``GET /v1/models``, ``/healthz``, ``/readyz``, ``/metrics``).
Request and response bodies are the models of :mod:`serving.schemas`, so ``/openapi.json`` (and
``/docs``) describe the API; the error contract is in :mod:`serving.api.errors`.
"""
