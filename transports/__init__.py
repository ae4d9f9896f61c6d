"""How an agent and a slot server reach each other's memory: the transport interface (``base``: regions, connections,
remote CAS, WRITE, WRITE_WITH_IMM, READ, completion queues), its registry, the loopback transport, the RDMA verbs
transport, and the connection manager both sides run for peers coming and going."""
