"""The GPU side's routed experts (the protocol: moe_exchange/protocol.py): in this process, one or
several expert services, hot experts computed here, long prefills' experts computed here."""
