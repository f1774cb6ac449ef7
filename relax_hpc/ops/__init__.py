"""Operations: run metrics (TensorBoard, summary, reward plot). Notifications come later."""
