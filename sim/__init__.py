"""The simulator: a SimPy model of an LLM engine's step loop. Importing it never imports torch."""
