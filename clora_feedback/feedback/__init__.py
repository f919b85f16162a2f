"""Feedback ingestion: reward policies, the durable feedback store and its connectors."""
