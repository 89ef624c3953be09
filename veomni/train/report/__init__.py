"""What a run reports: metric sinks, the run summary, the loss plot, the CPU peak and the baseline loss."""
