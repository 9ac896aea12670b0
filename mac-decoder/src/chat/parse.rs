//! The streaming parser of K3's output (spec K3_CHAT §3), on token ids.
//!
//! After a thinking prompt the model writes
//! `reasoning C think S O response S content C response S [O tools S calls… C tools S]
//! C message S E`. Markers (`O`=`<|open|>`, `C`=`<|close|>`, `S`=`<|sep|>`, `E`=`<|end_of_msg|>`)
//! are single special ids that content can never produce (content is encoded without special
//! tokens), so parsing ids tells a real marker from a literal `<|close|>` in an argument,
//! which text parsers cannot. Ordinary ids stream to the current channel with UTF-8 hold-back;
//! marker headers (the text between `O`/`C` and `S`) are never forwarded.

use std::sync::Arc;

use super::json::Json;
use crate::tokenizer::{names, Segment, Tokenizer, TokenizerError, Utf8Stream};

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `<|end_of_msg|>` (or `[EOS]`) with no tool call, or a client stop string.
    Stop,
    /// The message ended after at least one complete tool call.
    ToolCalls,
    /// `max_tokens` (or the context) ran out.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::ToolCalls => "tool_calls",
            FinishReason::Length => "length",
        }
    }
}

/// One parsed OpenAI tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// 0-based position among this message's calls.
    pub index: usize,
    pub id: String,
    pub name: String,
    /// A JSON object, as a string.
    pub arguments: String,
}

/// What one token (or the end of the stream) produced.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputEvent {
    Reasoning(String),
    Content(String),
    ToolCall(ToolCall),
}

/// Everything a finished generation said.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ParsedOutput {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
    pub finish_reason: Option<FinishReason>,
    /// Generated ids that belong to the reasoning (the think channel and its close marker).
    pub reasoning_tokens: usize,
    /// Calls the model wrote to tools the request did not declare (reported as content text,
    /// never returned as calls; see [`OutputParser::with_declared_tools`]).
    pub undeclared_tool_calls: Vec<String>,
    /// Marker spellings that reached a text channel as ordinary text and were removed, or a
    /// marker the stream ended inside (see [`MarkerText`]).
    pub stripped_markers: usize,
}

/// The ids of the markup tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MarkerIds {
    pub open: u32,
    pub close: u32,
    pub sep: u32,
    pub end_of_msg: u32,
    pub eos: Option<u32>,
}

impl MarkerIds {
    pub fn from_tokenizer(tok: &Tokenizer) -> Result<Self, TokenizerError> {
        let get = |n: &'static str| tok.special_id(n).ok_or(TokenizerError::MissingSpecial(n));
        Ok(MarkerIds {
            open: get(names::OPEN)?,
            close: get(names::CLOSE)?,
            sep: get(names::SEP)?,
            end_of_msg: get(names::END_OF_MSG)?,
            eos: tok.special_id(names::EOS),
        })
    }

    /// Ids that end generation.
    pub fn stop_ids(&self) -> Vec<u32> {
        let mut v = vec![self.end_of_msg];
        v.extend(self.eos);
        v
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Think,
    /// After `C think S`, before `O response S`.
    ResponsePending,
    Response,
    AfterResponse,
    Tools,
    Call,
    Argument,
    JsonBlock,
    AfterTools,
    Done,
}

#[derive(Debug, Default)]
struct PartialCall {
    name: Option<String>,
    args: Vec<(String, Json)>,
    json_text: Option<String>,
    /// The open argument: key, type, raw bytes.
    arg: Option<(String, String, Vec<u8>)>,
    json_buf: Vec<u8>,
}

/// Streaming parser of one generated assistant message.
pub struct OutputParser {
    tok: Arc<Tokenizer>,
    ids: MarkerIds,
    state: State,
    /// A marker header being collected: (is_open, bytes).
    header: Option<(bool, Vec<u8>)>,
    reasoning: Utf8Stream,
    content: Utf8Stream,
    /// Marker spellings in ordinary text, per channel.
    reasoning_guard: MarkerText,
    content_guard: MarkerText,
    call: Option<PartialCall>,
    call_id_prefix: String,
    /// Whether tool calls are returned (`false`: the request declared no tools, or said
    /// `tool_choice: "none"`; calls the model writes anyway are dropped, as vLLM and SGLang do).
    tool_calls: bool,
    /// The request's tool names: a call to another name is reported, not returned.
    declared: Option<Vec<String>>,
    out: ParsedOutput,
}

impl OutputParser {
    /// `thinking`: the prompt ended with `O think S` (else with `O response S`).
    /// Tool call ids are `{call_id_prefix}_{index}`.
    pub fn new(tok: Arc<Tokenizer>, thinking: bool, call_id_prefix: impl Into<String>) -> Result<Self, TokenizerError> {
        let ids = MarkerIds::from_tokenizer(&tok)?;
        Ok(OutputParser {
            tok,
            ids,
            state: if thinking { State::Think } else { State::Response },
            header: None,
            reasoning: Utf8Stream::new(),
            content: Utf8Stream::new(),
            reasoning_guard: MarkerText::default(),
            content_guard: MarkerText::default(),
            call: None,
            call_id_prefix: call_id_prefix.into(),
            tool_calls: true,
            declared: None,
            out: ParsedOutput::default(),
        })
    }

    /// Only calls to these tools are returned; a call naming another tool is reported as
    /// content text (`[call to undeclared tool "NAME": ARGUMENTS]`), logged and counted in
    /// [`ParsedOutput::undeclared_tool_calls`], never returned as a call the client would run.
    pub fn with_declared_tools(mut self, names: Vec<String>) -> Self {
        self.declared = Some(names);
        self
    }

    /// Drops tool calls instead of returning them (a request without tools, or with
    /// `tool_choice: "none"`); the finish reason is then never `tool_calls`.
    pub fn without_tool_calls(mut self) -> Self {
        self.tool_calls = false;
        self
    }

    pub fn marker_ids(&self) -> MarkerIds {
        self.ids
    }

    /// Whether generation has ended (a stop id arrived).
    pub fn is_finished(&self) -> bool {
        self.out.finish_reason.is_some()
    }

    /// The output so far (complete once finished).
    pub fn output(&self) -> &ParsedOutput {
        &self.out
    }

    pub fn into_output(self) -> ParsedOutput {
        self.out
    }

    /// Feeds one generated id; returns what it produced. After a stop id, ids are ignored.
    pub fn push(&mut self, id: u32) -> Vec<OutputEvent> {
        let mut ev = Vec::new();
        if self.is_finished() {
            return ev;
        }
        if self.state == State::Think {
            self.out.reasoning_tokens += 1;
        }
        if id == self.ids.end_of_msg || Some(id) == self.ids.eos {
            self.end_header(&mut ev);
            let reason = if self.out.tool_calls.is_empty() { FinishReason::Stop } else { FinishReason::ToolCalls };
            self.finish_into(reason, &mut ev);
            return ev;
        }
        if id == self.ids.open || id == self.ids.close {
            // A marker while another header is open: the earlier one lacked its `S`.
            self.end_header(&mut ev);
            self.header = Some((id == self.ids.open, Vec::new()));
            return ev;
        }
        if id == self.ids.sep {
            if self.header.is_some() {
                self.end_header(&mut ev);
            } else {
                tracing::debug!("stray <|sep|> in the output; dropped");
            }
            return ev;
        }
        let bytes = match self.tok.token_bytes(id) {
            Some(b) => b.to_vec(),
            None => {
                tracing::warn!(id, "generated id outside the vocabulary; dropped");
                return ev;
            }
        };
        if let Some((_, h)) = &mut self.header {
            h.extend_from_slice(&bytes);
            return ev;
        }
        self.text(&bytes, &mut ev);
        ev
    }

    /// The markup that closes the element the output is in, one element at a time (a marker
    /// header still open: its `S`), for [`super::budget::ReplyBudget`]. `reasoning_only`: only
    /// leave the reasoning (close `think`, open `response`); `None` when nothing is to close
    /// for that purpose.
    pub(super) fn closing_markup(&self, reasoning_only: bool) -> Option<Vec<Segment>> {
        let m = Segment::markup;
        let close = |tag: &str| vec![m(names::CLOSE), Segment::text(tag), m(names::SEP)];
        if self.is_finished() {
            return None;
        }
        if self.header.is_some() {
            return Some(vec![m(names::SEP)]);
        }
        let out = match self.state {
            State::Think => {
                let mut v = close("think");
                v.extend([m(names::OPEN), Segment::text("response"), m(names::SEP)]);
                v
            }
            State::ResponsePending => vec![m(names::OPEN), Segment::text("response"), m(names::SEP)],
            _ if reasoning_only => return None,
            State::Response => close("response"),
            State::Tools => close("tools"),
            State::Call => close("call"),
            State::Argument => close("argument"),
            State::JsonBlock => close("json"),
            State::AfterResponse | State::AfterTools => close("message"),
            State::Done => vec![m(names::END_OF_MSG)],
        };
        Some(out)
    }

    /// Ends the stream without a stop id (`max_tokens` reached, or a client stop string):
    /// flushes held-back bytes and keeps only complete tool calls.
    pub fn finish(&mut self, reason: FinishReason) -> Vec<OutputEvent> {
        let mut ev = Vec::new();
        if self.is_finished() {
            return ev;
        }
        // A marker header the stream ended in (no `S`): dropped, it is markup, not text.
        if let Some((open, bytes)) = self.header.take() {
            tracing::debug!(open, header = %String::from_utf8_lossy(&bytes), "output ended inside a marker; dropped");
            self.out.stripped_markers += 1;
        }
        self.finish_into(reason, &mut ev);
        ev
    }

    fn finish_into(&mut self, reason: FinishReason, ev: &mut Vec<OutputEvent>) {
        self.flush_reasoning(ev);
        self.flush_content(ev);
        if self.call.take().is_some() {
            tracing::warn!(state = ?self.state, "output ended inside a tool call; the incomplete call is dropped");
        }
        self.out.finish_reason = Some(reason);
        self.state = State::Done;
    }

    fn flush_reasoning(&mut self, ev: &mut Vec<OutputEvent>) {
        let mut s = self.reasoning_guard.push(&self.reasoning.finish());
        s.push_str(&self.reasoning_guard.finish());
        self.out.stripped_markers += self.reasoning_guard.take_stripped();
        if !s.is_empty() {
            self.out.reasoning.push_str(&s);
            ev.push(OutputEvent::Reasoning(s));
        }
    }

    fn flush_content(&mut self, ev: &mut Vec<OutputEvent>) {
        let mut s = self.content_guard.push(&self.content.finish());
        s.push_str(&self.content_guard.finish());
        self.out.stripped_markers += self.content_guard.take_stripped();
        if !s.is_empty() {
            self.out.content.push_str(&s);
            ev.push(OutputEvent::Content(s));
        }
    }

    fn text(&mut self, bytes: &[u8], ev: &mut Vec<OutputEvent>) {
        match self.state {
            State::Think => {
                let s = self.reasoning_guard.push(&self.reasoning.push(bytes));
                self.out.stripped_markers += self.reasoning_guard.take_stripped();
                if !s.is_empty() {
                    self.out.reasoning.push_str(&s);
                    ev.push(OutputEvent::Reasoning(s));
                }
            }
            State::ResponsePending | State::Response => {
                // Text right after the think close without `O response S`: it is the response.
                self.state = State::Response;
                let s = self.content_guard.push(&self.content.push(bytes));
                self.out.stripped_markers += self.content_guard.take_stripped();
                if !s.is_empty() {
                    self.out.content.push_str(&s);
                    ev.push(OutputEvent::Content(s));
                }
            }
            State::Argument => {
                if let Some((_, _, buf)) = self.call.as_mut().and_then(|c| c.arg.as_mut()) {
                    buf.extend_from_slice(bytes);
                }
            }
            State::JsonBlock => {
                if let Some(c) = self.call.as_mut() {
                    c.json_buf.extend_from_slice(bytes);
                }
            }
            State::AfterResponse | State::Tools | State::Call | State::AfterTools | State::Done => {
                // Text outside elements: normally none; discarded.
            }
        }
    }

    /// Acts on a complete marker header (`S` arrived, or was implied).
    fn end_header(&mut self, ev: &mut Vec<OutputEvent>) {
        let Some((is_open, bytes)) = self.header.take() else { return };
        let text = String::from_utf8_lossy(&bytes);
        let text = text.trim();
        let tag_end = text.find(char::is_whitespace).unwrap_or(text.len());
        let (tag, attrs) = (&text[..tag_end], &text[tag_end..]);
        match (is_open, tag) {
            // A think block opening after the reasoning (inside or after the response channel):
            // its text is reasoning, not content; the response resumes after `C think S`.
            (true, "think") => {
                self.flush_content(ev);
                if matches!(self.state, State::Response | State::ResponsePending | State::AfterResponse) {
                    self.state = State::Think;
                }
            }
            (false, "think") if self.state != State::Think => self.stray_close(tag),
            (false, "think") => {
                self.flush_reasoning(ev);
                self.state = State::ResponsePending;
            }
            (true, "response") => {
                self.flush_reasoning(ev);
                self.state = State::Response;
            }
            (false, "response") if !matches!(self.state, State::Response | State::ResponsePending) => self.stray_close(tag),
            (false, "response") => {
                self.flush_reasoning(ev);
                self.flush_content(ev);
                self.state = State::AfterResponse;
            }
            (true, "tools") => {
                self.flush_reasoning(ev);
                self.flush_content(ev);
                self.state = State::Tools;
            }
            (false, "tools") if !matches!(self.state, State::Tools | State::Call | State::Argument | State::JsonBlock) => self.stray_close(tag),
            (false, "tools") => {
                if self.call.take().is_some() {
                    tracing::warn!("tools closed inside a call; the incomplete call is dropped");
                }
                self.state = State::AfterTools
            }
            (true, "call") => {
                self.flush_reasoning(ev);
                self.flush_content(ev);
                let name = parse_attrs(attrs).into_iter().find(|(k, _)| k == "tool").map(|(_, v)| v);
                self.call = Some(PartialCall { name, ..Default::default() });
                self.state = State::Call;
            }
            (false, "call") if self.call.is_none() => self.stray_close(tag),
            (false, "call") => {
                if let Some(mut call) = self.call.take() {
                    // An argument left open: closed by the call's end.
                    if let Some(arg) = call.arg.take() {
                        store_argument(&mut call, arg);
                    }
                    self.complete_call(call, ev);
                }
                self.state = State::Tools;
            }
            (true, "argument") => {
                let a = parse_attrs(attrs);
                let key = a.iter().find(|(k, _)| k == "key").map(|(_, v)| v.clone());
                let ty = a.iter().find(|(k, _)| k == "type").map(|(_, v)| v.clone()).unwrap_or_else(|| "string".into());
                match (self.call.as_mut(), key) {
                    (Some(c), Some(key)) => {
                        c.arg = Some((key, ty, Vec::new()));
                        self.state = State::Argument;
                    }
                    _ => tracing::warn!("argument element without a key or outside a call; ignored"),
                }
            }
            (false, "argument") if self.state != State::Argument => self.stray_close(tag),
            (false, "argument") => {
                if let Some(c) = self.call.as_mut() {
                    if let Some(arg) = c.arg.take() {
                        store_argument(c, arg);
                    }
                }
                self.state = State::Call;
            }
            (true, "json") => {
                if let Some(c) = self.call.as_mut() {
                    c.json_buf.clear();
                    self.state = State::JsonBlock;
                }
            }
            (false, "json") if self.state != State::JsonBlock => self.stray_close(tag),
            (false, "json") => {
                if let Some(c) = self.call.as_mut() {
                    c.json_text = Some(String::from_utf8_lossy(&c.json_buf).into_owned());
                    self.state = State::Call;
                }
            }
            (false, "message") => {
                self.flush_reasoning(ev);
                self.flush_content(ev);
                self.state = State::Done;
            }
            _ => {
                tracing::warn!(open = is_open, header = %text, "unknown marker in the output; dropped");
            }
        }
    }

    /// A close marker whose element is not open: it closes nothing and is dropped (the
    /// channel goes on as before).
    fn stray_close(&mut self, tag: &str) {
        tracing::warn!(tag, state = ?self.state, "close marker without its open in the output; dropped");
        self.out.stripped_markers += 1;
    }

    fn complete_call(&mut self, call: PartialCall, ev: &mut Vec<OutputEvent>) {
        let Some(name) = call.name.filter(|n| !n.is_empty()) else {
            tracing::warn!("tool call without a `tool` attribute; dropped");
            return;
        };
        if !self.tool_calls {
            tracing::info!(tool = %name, "the model called a tool although the request allows none; dropped");
            return;
        }
        let arguments = match call.json_text {
            Some(raw) => match Json::parse_keeping_numbers(&raw) {
                Ok(v @ Json::Object(_)) => v.dumps_py(),
                _ => raw,
            },
            None => Json::Object(call.args).dumps_py(),
        };
        if let Some(declared) = &self.declared {
            if !declared.contains(&name) {
                tracing::warn!(tool = %name, "the model called a tool the request does not declare; reported as text, not returned as a call");
                let text = format!("[call to undeclared tool {}: {arguments}]", Json::Str(name.clone()).dumps_py());
                self.out.content.push_str(&text);
                self.out.undeclared_tool_calls.push(name);
                ev.push(OutputEvent::Content(text));
                return;
            }
        }
        let index = self.out.tool_calls.len();
        let tc = ToolCall { index, id: format!("{}_{index}", self.call_id_prefix), name, arguments };
        self.out.tool_calls.push(tc.clone());
        ev.push(OutputEvent::ToolCall(tc));
    }
}

/// Stores a finished argument element in its call: strings raw, other types parsed as JSON with
/// their number literals kept (else kept as the raw string); a repeated key: the last wins.
fn store_argument(c: &mut PartialCall, (key, ty, raw): (String, String, Vec<u8>)) {
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let value = if ty == "string" { Json::Str(raw) } else { Json::parse_keeping_numbers(&raw).unwrap_or(Json::Str(raw)) };
    match c.args.iter_mut().find(|(k, _)| *k == key) {
        Some(slot) => slot.1 = value,
        None => c.args.push((key, value)),
    }
}

/// The spellings of K3's markers. As special ids they never reach a text channel; a model can
/// still write their *spelling* with ordinary tokens (an undertrained or random model does).
const MARKER_SPELLINGS: [&str; 4] = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"];
/// The element names of K3's reply grammar (a spelled marker header names one of these).
const ELEMENTS: [&str; 7] = ["think", "response", "tools", "call", "argument", "json", "message"];
/// How far a spelled marker header is followed before it is cut at its tag name.
const MAX_SPELLED_HEADER: usize = 512;

/// Removes spelled markers from a text channel (spec K3_CHAT §3.4: never forward markers): a
/// spelled `<|sep|>` / `<|end_of_msg|>`, and a spelled `<|open|>` / `<|close|>` followed by an
/// element name (through its spelled `<|sep|>` when one follows). Text that could still become
/// one is held back; what is held when the channel ends (`<|`, `<|open|>tools`,
/// `<|close|>response`) is a fragment of a marker and is dropped. Any other `<|` is text.
#[derive(Debug, Default)]
struct MarkerText {
    held: String,
    stripped: usize,
}

/// What the text at a `<|` is.
enum Spelled {
    /// Could still become a marker: wait for more text.
    Partial,
    /// A marker of this many bytes.
    Marker(usize),
    /// Not a marker.
    Text,
}

fn spelled_marker(s: &str) -> Spelled {
    if MARKER_SPELLINGS.iter().any(|m| s.len() < m.len() && m.starts_with(s)) {
        return Spelled::Partial;
    }
    for m in ["<|sep|>", "<|end_of_msg|>"] {
        if s.starts_with(m) {
            return Spelled::Marker(m.len());
        }
    }
    let Some(rest) = s.strip_prefix("<|open|>").or_else(|| s.strip_prefix("<|close|>")) else {
        return Spelled::Text;
    };
    let head = s.len() - rest.len();
    let lead = rest.len() - rest.trim_start_matches(' ').len();
    let word: String = rest[lead..].chars().take_while(|c| c.is_ascii_lowercase()).collect();
    let after = head + lead + word.len();
    if after == s.len() {
        // Nothing after the name yet: it may still grow into an element's.
        let could = ELEMENTS.iter().any(|e| e.starts_with(word.as_str())) && lead + word.len() < MAX_SPELLED_HEADER;
        return if could { Spelled::Partial } else { Spelled::Text };
    }
    if !ELEMENTS.contains(&word.as_str()) {
        return Spelled::Text;
    }
    // Through the header's spelled `<|sep|>` (attributes between), else up to the tag name.
    let tail = &s[after..];
    match (tail.find("<|sep|>"), tail.find("<|")) {
        (Some(p), Some(q)) if p == q && p <= MAX_SPELLED_HEADER => Spelled::Marker(after + p + "<|sep|>".len()),
        // Another spelling starts first: a partial `<|sep|>` may still complete the header.
        (None, Some(q)) if "<|sep|>".starts_with(&tail[q..]) && q <= MAX_SPELLED_HEADER => Spelled::Partial,
        (_, Some(_)) => Spelled::Marker(after),
        (_, None) if tail.contains('\n') || tail.len() > MAX_SPELLED_HEADER => Spelled::Marker(after),
        // Attributes may still be coming.
        (_, None) => Spelled::Partial,
    }
}

impl MarkerText {
    /// Adds text; returns the part that can go out.
    fn push(&mut self, text: &str) -> String {
        if self.held.is_empty() && !text.contains('<') {
            return text.to_string();
        }
        self.held.push_str(text);
        let mut out = String::new();
        loop {
            let Some(p) = self.held.find("<|") else {
                // A lone trailing `<` may start one.
                let keep = if self.held.ends_with('<') { self.held.len() - 1 } else { self.held.len() };
                out.push_str(&self.held[..keep]);
                self.held.drain(..keep);
                return out;
            };
            out.push_str(&self.held[..p]);
            self.held.drain(..p);
            match spelled_marker(&self.held) {
                Spelled::Partial => return out,
                Spelled::Marker(n) => {
                    tracing::debug!(marker = %&self.held[..n], "marker spelled in ordinary text; removed");
                    self.stripped += 1;
                    self.held.drain(..n);
                }
                Spelled::Text => {
                    out.push_str("<|");
                    self.held.drain(..2);
                }
            }
        }
    }

    /// The channel ended: a held fragment of a marker is dropped, a lone `<` goes out.
    fn finish(&mut self) -> String {
        let held = std::mem::take(&mut self.held);
        if held == "<" || held.is_empty() {
            return held;
        }
        tracing::debug!(fragment = %held, "text ended inside a spelled marker; dropped");
        self.stripped += 1;
        String::new()
    }

    fn take_stripped(&mut self) -> usize {
        std::mem::take(&mut self.stripped)
    }
}

/// `(\w+)="([^"]*)"` over a header's attribute text, values unescaped (`&quot;` then `&amp;`).
fn parse_attrs(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        // Find `="`, then take the word characters before it.
        let Some(eq) = s[i..].find("=\"").map(|p| p + i) else { break };
        let key_start = s[..eq].char_indices().rev().take_while(|(_, c)| c.is_alphanumeric() || *c == '_').last().map(|(p, _)| p).unwrap_or(eq);
        let val_start = eq + 2;
        let Some(end) = s[val_start..].find('"').map(|p| p + val_start) else { break };
        if key_start < eq {
            let val = s[val_start..end].replace("&quot;", "\"").replace("&amp;", "&");
            out.push((s[key_start..eq].to_string(), val));
        }
        i = end + 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{parse_attrs, MarkerText};

    /// The text a channel lets out when `pieces` arrive one by one, and how many markers it
    /// removed.
    fn guarded(pieces: &[&str]) -> (String, usize) {
        let mut g = MarkerText::default();
        let mut out = String::new();
        for p in pieces {
            out.push_str(&g.push(p));
        }
        out.push_str(&g.finish());
        (out, g.stripped)
    }

    #[test]
    fn spelled_markers_never_reach_a_channel() {
        // Whole, and split at every byte.
        for (text, want, n) in [
            ("plain <b>html</b> and a < b", "plain <b>html</b> and a < b", 0),
            ("done<|close|>response<|sep|>", "done", 1),
            ("a<|open|>call tool=\"f\" index=\"1\"<|sep|>b", "ab", 1),
            ("x<|end_of_msg|>", "x", 1),
            ("ends in <|", "ends in ", 1),
            ("ends in <|open|>tools", "ends in ", 1),
            ("ends in <|close|>response", "ends in ", 1),
            ("ends in <|open|> tools<|se", "ends in ", 1),
            ("<|im_start|> is another model's", "<|im_start|> is another model's", 0),
            ("<|open|>banana stays", "<|open|>banana stays", 0),
            ("a <", "a <", 0),
        ] {
            assert_eq!(guarded(&[text]), (want.to_string(), n), "{text:?} whole");
            let bytes: Vec<String> = text.chars().map(String::from).collect();
            let pieces: Vec<&str> = bytes.iter().map(String::as_str).collect();
            assert_eq!(guarded(&pieces), (want.to_string(), n), "{text:?} char by char");
        }
    }

    #[test]
    fn attrs_are_parsed_and_unescaped() {
        assert_eq!(parse_attrs(r#" tool="get_weather" index="1""#), vec![("tool".into(), "get_weather".into()), ("index".into(), "1".into())]);
        assert_eq!(parse_attrs(r#" key="a &quot;b&quot; &amp;amp;" type="string""#)[0].1, "a \"b\" &amp;");
        assert!(parse_attrs(" broken=\"x").is_empty());
    }
}
