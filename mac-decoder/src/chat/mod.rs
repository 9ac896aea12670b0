//! K3's chat format (spec K3_CHAT §2–3): prompt rendering into segments and the streaming
//! parser of the model's output (on token ids) into reasoning, content and tool calls.

pub mod budget;
pub mod constrain;
pub mod grammar;
pub mod json;
pub mod parse;
pub mod render;

pub use json::Json;
pub use parse::{FinishReason, OutputEvent, OutputParser, ParsedOutput, ToolCall};
pub use render::{render, render_text, RenderError, RenderOptions};
