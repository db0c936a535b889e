"""The Gradio chat app: controller (state and actions), panels (plots), inspector (HTML), layout."""
