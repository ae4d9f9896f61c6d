"""The wire contract between an agent and a slot server: every word, immediate and header of the slot ABI
(``wire``), and the typed views of slot pools and frame arrays (``pool``)."""
