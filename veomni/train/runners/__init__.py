"""Step runners: how one optimizer step and one evaluation run (plain, pipeline, graph pipeline)."""
