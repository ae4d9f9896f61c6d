"""The API shapes the edge serves: each parses a request body into one unit of work
(:class:`~edgepath.edge.http.Work`) and formats its answer and errors in its own shape, over one submit path.
edgepath's own (``generate``), OpenAI's (``openai``, ``openai_routes``), and what they share: the sampling fields,
structured outputs (``structured``), tools (``tools``)."""
