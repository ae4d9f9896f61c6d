"""Who a request is and what it may spend: API keys (``auth``), tenants and their cache namespaces (``tenants``,
``tenants_file``), quotas (``quota``), the usage log (``usage``), and the tenant gate that reserves and settles them
for the lifecycle (``gate``).  Nothing here speaks HTTP."""
