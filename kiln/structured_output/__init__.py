"""Structured outputs: grammars from schemas, regexes, choices and EBNF, compiled in the engine
core off the step's path, and the per-step token bitmask that keeps sampling inside them."""
