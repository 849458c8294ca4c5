"""The compile stack: Dynamo traced once, the graph split at attention, each piece compiled by
Inductor with Kiln's passes, cached on disk and called without guards (docs/architecture.md, 3)."""
