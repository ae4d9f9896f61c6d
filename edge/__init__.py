"""The edge: HTTP/3 and HTTP/1.1 in, a request tokenized once into registered memory, handed to the agent, and its
answer streamed back.  Its rooms (``tests/test_layers.py`` says which may import which):

- ``adapters/`` -- the transports a client speaks: QUIC (aioquic or qh3), HTTP/1.1, TLS;
- ``apis/`` -- the API shapes, each a parser into one unit of work and a formatter of its answer: edgepath's own
  (``generate``), OpenAI's; and what they share (sampling fields, structured outputs, tools);
- ``tenancy/`` -- who a request is and what it may spend: keys, tenants, quotas, usage, the tenant gate;
- ``text/`` -- the model's own text: tokenizers, chat templates, incremental detokenizing, stop strings;
- at the top, the vocabulary every room speaks (``http``, ``actions``, ``refusals``, ``body``), the engine that runs
  a request (``routes``, ``lifecycle``, ``tracked``, ``tokenizing``, ``choices``, ``billing``, ``measure``,
  ``service``, ``ops``, ``metrics``) and the client (``client``, ``retry``).
"""
