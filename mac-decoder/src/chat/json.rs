//! An order-preserving JSON value with Python-compatible serialisation.
//!
//! K3's renderer is Python: tool-call arguments keep the client's key order and are written
//! with `json.dumps(v, ensure_ascii=False)` (separators `", "` and `": "`, floats as Python's
//! `repr`: `1e+20`, `1.0`); tool declarations and response schemas are deep key-sorted and
//! written compactly. `serde_json::Value` sorts keys unless the crate-wide `preserve_order`
//! feature is on (which would change other crates' output), so the chat code uses this type.
//! It deserialises through serde from any serde format (entries in document order; a repeated
//! key keeps its first position and its last value, as Python's `dict` does).
//!
//! Untrusted bodies go through [`Json::parse_limited`]: every cap of [`JsonLimits`] (keys per
//! object, items per array, nesting, string bytes) is checked as the text is read, so a body
//! past one stops the parse where it is; a repeated key is found through a hash index once an
//! object is past a few keys, so parsing is linear in the text.

use std::collections::HashMap;
use std::fmt::Write as _;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};

/// A JSON value whose objects keep their key order.
#[derive(Debug, Clone, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    /// A number kept as its literal text ([`Json::parse_keeping_numbers`]): one that
    /// [`Json::dumps_py`] would otherwise write differently (`1.50`, `1e3`, an integer past
    /// 64 bits), so a value the model wrote is rendered back exactly as written.
    Number(String),
    Str(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

/// Caps of a parse of untrusted JSON ([`Json::parse_limited`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JsonLimits {
    /// Keys one object may hold (a repeated key counts once).
    pub max_keys: usize,
    /// Items one array may hold.
    pub max_items: usize,
    /// Nesting of objects and arrays.
    pub max_depth: usize,
    /// Bytes of one string (a key or a value).
    pub max_string_bytes: usize,
}

impl JsonLimits {
    /// The caps of an API request body: 10,000 keys an object (a tool schema's `properties`
    /// holds tens), 2,097,152 items an array (a token-id prompt of twice the largest context),
    /// nesting 64, and strings up to the body's own size (a data-URL image is one string).
    pub const fn request(max_body_bytes: usize) -> JsonLimits {
        JsonLimits { max_keys: 10_000, max_items: 2 << 20, max_depth: 64, max_string_bytes: max_body_bytes }
    }
}

/// Builds an object's entries: a repeated key keeps its first position and takes the last
/// value. Small objects compare keys in order; past [`ObjectBuilder::INDEX_AFTER`] keys a hash
/// index finds them, so an object of n keys costs O(n).
struct ObjectBuilder {
    entries: Vec<(String, Json)>,
    index: Option<HashMap<String, usize>>,
}

impl ObjectBuilder {
    const INDEX_AFTER: usize = 16;

    fn new() -> Self {
        ObjectBuilder { entries: Vec::new(), index: None }
    }

    fn len(&self) -> usize {
        self.entries.len()
    }

    fn insert(&mut self, k: String, v: Json) {
        let found = match &self.index {
            Some(ix) => {
                probe_count(1);
                ix.get(&k).copied()
            }
            None => {
                probe_count(self.entries.len() as u64);
                self.entries.iter().position(|(ek, _)| *ek == k)
            }
        };
        match found {
            Some(i) => self.entries[i].1 = v,
            None => {
                if let Some(ix) = self.index.as_mut() {
                    ix.insert(k.clone(), self.entries.len());
                }
                self.entries.push((k, v));
                if self.index.is_none() && self.entries.len() > Self::INDEX_AFTER {
                    self.index = Some(self.entries.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)).collect());
                }
            }
        }
    }

    fn finish(self) -> Json {
        Json::Object(self.entries)
    }
}

#[cfg(test)]
thread_local! {
    /// Key comparisons (or index look-ups) made by [`ObjectBuilder::insert`] on this thread.
    static KEY_PROBES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

#[inline]
fn probe_count(_n: u64) {
    #[cfg(test)]
    KEY_PROBES.with(|c| c.set(c.get() + _n));
}

impl Json {
    /// Parses JSON text, keeping key order.
    pub fn parse(text: &str) -> Result<Json, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// Parses untrusted JSON text within `limits`: the first cap passed ends the parse with an
    /// error naming it (and where in the text it was).
    pub fn parse_limited(text: &str, limits: &JsonLimits) -> Result<Json, serde_json::Error> {
        let mut de = serde_json::Deserializer::from_str(text);
        let v = de::DeserializeSeed::deserialize(Limited { limits, depth: 0 }, &mut de)?;
        de.end()?;
        Ok(v)
    }

    /// Parses JSON text like [`Json::parse`], but numbers whose Python form (`json.dumps`)
    /// would differ from the text (`1.50`, `1E3`, `-0`, integers past 64 bits) are kept as
    /// [`Json::Number`] with their literal, so dumping gives the text back. Used for tool-call
    /// arguments: the model's own argument text, returned to the client and sent back in the
    /// next turn's history, then re-renders to the ids the model generated.
    pub fn parse_keeping_numbers(text: &str) -> Result<Json, LiteralError> {
        let mut p = LiteralParser { s: text.as_bytes(), i: 0 };
        p.ws();
        let v = p.value(0)?;
        p.ws();
        if p.i != p.s.len() {
            return Err(p.err("trailing characters"));
        }
        Ok(v)
    }

    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Object(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Json]> {
        match self {
            Json::Array(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_object(&self) -> Option<&[(String, Json)]> {
        match self {
            Json::Object(v) => Some(v),
            _ => None,
        }
    }

    pub fn is_null(&self) -> bool {
        matches!(self, Json::Null)
    }

    /// Python truthiness (`if value:`): null, false, 0, "", [] and {} are false.
    pub fn truthy(&self) -> bool {
        match self {
            Json::Null => false,
            Json::Bool(b) => *b,
            Json::Int(i) => *i != 0,
            Json::UInt(u) => *u != 0,
            Json::Float(f) => *f != 0.0,
            Json::Number(n) => n.parse::<f64>() != Ok(0.0),
            Json::Str(s) => !s.is_empty(),
            Json::Array(a) => !a.is_empty(),
            Json::Object(o) => !o.is_empty(),
        }
    }

    /// The XTML `type` attribute of a value (spec K3_CHAT §2.4).
    pub fn xtml_type(&self) -> &'static str {
        match self {
            Json::Null => "null",
            Json::Bool(_) => "boolean",
            Json::Int(_) | Json::UInt(_) | Json::Float(_) | Json::Number(_) => "number",
            Json::Str(_) => "string",
            Json::Object(_) => "object",
            Json::Array(_) => "array",
        }
    }

    /// Every object at every depth with its keys sorted by code point (Python `sorted`).
    pub fn deep_sorted(&self) -> Json {
        match self {
            Json::Object(entries) => {
                let mut e: Vec<(String, Json)> = entries.iter().map(|(k, v)| (k.clone(), v.deep_sorted())).collect();
                // Python sorts str by code point; Rust's str Ord is byte order of UTF-8, which
                // orders code points the same way.
                e.sort_by(|a, b| a.0.cmp(&b.0));
                Json::Object(e)
            }
            Json::Array(items) => Json::Array(items.iter().map(Json::deep_sorted).collect()),
            other => other.clone(),
        }
    }

    /// Python `json.dumps(v, ensure_ascii=False)`: separators `", "` and `": "`.
    pub fn dumps_py(&self) -> String {
        let mut s = String::new();
        self.write_py(&mut s, ", ", ": ");
        s
    }

    /// Python `json.dumps(v, ensure_ascii=False, separators=(",", ":"))`.
    pub fn dumps_compact(&self) -> String {
        let mut s = String::new();
        self.write_py(&mut s, ",", ":");
        s
    }

    fn write_py(&self, out: &mut String, item_sep: &str, key_sep: &str) {
        match self {
            Json::Null => out.push_str("null"),
            Json::Bool(true) => out.push_str("true"),
            Json::Bool(false) => out.push_str("false"),
            Json::Int(i) => {
                let _ = write!(out, "{i}");
            }
            Json::UInt(u) => {
                let _ = write!(out, "{u}");
            }
            Json::Float(f) => out.push_str(&py_float_repr(*f)),
            Json::Number(n) => out.push_str(n),
            Json::Str(s) => write_py_string(out, s),
            Json::Array(items) => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(item_sep);
                    }
                    v.write_py(out, item_sep, key_sep);
                }
                out.push(']');
            }
            Json::Object(entries) => {
                out.push('{');
                for (i, (k, v)) in entries.iter().enumerate() {
                    if i > 0 {
                        out.push_str(item_sep);
                    }
                    write_py_string(out, k);
                    out.push_str(key_sep);
                    v.write_py(out, item_sep, key_sep);
                }
                out.push('}');
            }
        }
    }

    /// Conversion to `serde_json::Value` (key order is then serde_json's).
    pub fn to_value(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }
}

/// A JSON string literal as Python's `json.dumps(..., ensure_ascii=False)` writes it.
fn write_py_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)` (what `json.dumps` writes for floats): the shortest digits that
/// round-trip; positional notation when the decimal exponent is in `[-4, 16)`, else
/// `d.ddde+XX`; a positional integer value keeps `.0`.
pub fn py_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.2345e-5".
    let sci = format!("{x:e}");
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let neg = mant.starts_with('-');
    let digits: String = mant.chars().filter(|c| c.is_ascii_digit()).collect();
    let mut out = String::new();
    if neg {
        out.push('-');
    }
    if !(-4..16).contains(&exp) {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    } else if exp >= 0 {
        let int_len = exp as usize + 1;
        if digits.len() <= int_len {
            out.push_str(&digits);
            out.extend(std::iter::repeat_n('0', int_len - digits.len()));
            out.push_str(".0");
        } else {
            out.push_str(&digits[..int_len]);
            out.push('.');
            out.push_str(&digits[int_len..]);
        }
    } else {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', (-exp - 1) as usize));
        out.push_str(&digits);
    }
    out
}

/// Why [`Json::parse_keeping_numbers`] refused a text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid JSON at byte {at}: {what}")]
pub struct LiteralError {
    pub at: usize,
    pub what: &'static str,
}

/// Nesting deeper than this is refused (the input is model output or a client's arguments).
const MAX_DEPTH: usize = 256;

struct LiteralParser<'a> {
    s: &'a [u8],
    i: usize,
}

impl LiteralParser<'_> {
    fn err(&self, what: &'static str) -> LiteralError {
        LiteralError { at: self.i, what }
    }
    fn ws(&mut self) {
        while self.i < self.s.len() && matches!(self.s[self.i], b' ' | b'\t' | b'\n' | b'\r') {
            self.i += 1;
        }
    }
    fn eat(&mut self, lit: &[u8]) -> bool {
        if self.s[self.i..].starts_with(lit) {
            self.i += lit.len();
            true
        } else {
            false
        }
    }
    fn value(&mut self, depth: usize) -> Result<Json, LiteralError> {
        if depth > MAX_DEPTH {
            return Err(self.err("nested too deeply"));
        }
        match self.s.get(self.i) {
            None => Err(self.err("unexpected end")),
            Some(b'{') => {
                self.i += 1;
                let mut entries = ObjectBuilder::new();
                self.ws();
                if self.eat(b"}") {
                    return Ok(entries.finish());
                }
                loop {
                    self.ws();
                    if self.s.get(self.i) != Some(&b'"') {
                        return Err(self.err("expected a string key"));
                    }
                    let k = self.string()?;
                    self.ws();
                    if !self.eat(b":") {
                        return Err(self.err("expected `:`"));
                    }
                    self.ws();
                    let v = self.value(depth + 1)?;
                    entries.insert(k, v);
                    self.ws();
                    if self.eat(b",") {
                        continue;
                    }
                    if self.eat(b"}") {
                        return Ok(entries.finish());
                    }
                    return Err(self.err("expected `,` or `}`"));
                }
            }
            Some(b'[') => {
                self.i += 1;
                let mut items = Vec::new();
                self.ws();
                if self.eat(b"]") {
                    return Ok(Json::Array(items));
                }
                loop {
                    self.ws();
                    items.push(self.value(depth + 1)?);
                    self.ws();
                    if self.eat(b",") {
                        continue;
                    }
                    if self.eat(b"]") {
                        return Ok(Json::Array(items));
                    }
                    return Err(self.err("expected `,` or `]`"));
                }
            }
            Some(b'"') => Ok(Json::Str(self.string()?)),
            Some(b't') if self.eat(b"true") => Ok(Json::Bool(true)),
            Some(b'f') if self.eat(b"false") => Ok(Json::Bool(false)),
            Some(b'n') if self.eat(b"null") => Ok(Json::Null),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(_) => Err(self.err("unexpected character")),
        }
    }
    fn digits(&mut self) -> usize {
        let start = self.i;
        while self.i < self.s.len() && self.s[self.i].is_ascii_digit() {
            self.i += 1;
        }
        self.i - start
    }
    fn number(&mut self) -> Result<Json, LiteralError> {
        let start = self.i;
        self.eat(b"-");
        let int_start = self.i;
        if self.digits() == 0 {
            return Err(self.err("a number needs digits"));
        }
        if self.s[int_start] == b'0' && self.i - int_start > 1 {
            return Err(self.err("a number may not start with 0"));
        }
        let mut is_int = true;
        if self.eat(b".") {
            is_int = false;
            if self.digits() == 0 {
                return Err(self.err("digits must follow `.`"));
            }
        }
        if matches!(self.s.get(self.i), Some(b'e' | b'E')) {
            is_int = false;
            self.i += 1;
            if matches!(self.s.get(self.i), Some(b'+' | b'-')) {
                self.i += 1;
            }
            if self.digits() == 0 {
                return Err(self.err("digits must follow the exponent"));
            }
        }
        let lit = std::str::from_utf8(&self.s[start..self.i]).map_err(|_| self.err("not UTF-8"))?;
        if is_int {
            if let Ok(i) = lit.parse::<i64>() {
                if lit != "-0" {
                    return Ok(Json::Int(i));
                }
            } else if let Ok(u) = lit.parse::<u64>() {
                return Ok(Json::UInt(u));
            }
            return Ok(Json::Number(lit.to_string()));
        }
        match lit.parse::<f64>() {
            Ok(f) if f.is_finite() && py_float_repr(f) == lit => Ok(Json::Float(f)),
            _ => Ok(Json::Number(lit.to_string())),
        }
    }
    fn hex4(&mut self) -> Result<u32, LiteralError> {
        let h = self.s.get(self.i..self.i + 4).ok_or_else(|| self.err("short \\u escape"))?;
        let h = std::str::from_utf8(h).map_err(|_| self.err("bad \\u escape"))?;
        let v = u32::from_str_radix(h, 16).map_err(|_| self.err("bad \\u escape"))?;
        self.i += 4;
        Ok(v)
    }
    fn string(&mut self) -> Result<String, LiteralError> {
        self.i += 1; // the opening quote
        let mut out: Vec<u8> = Vec::new();
        loop {
            let Some(&c) = self.s.get(self.i) else { return Err(self.err("unterminated string")) };
            self.i += 1;
            match c {
                b'"' => break,
                b'\\' => {
                    let Some(&e) = self.s.get(self.i) else { return Err(self.err("unterminated escape")) };
                    self.i += 1;
                    let ch = match e {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{08}',
                        b'f' => '\u{0c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let hi = self.hex4()?;
                            let cp = if (0xD800..0xDC00).contains(&hi) && self.eat(b"\\u") {
                                let lo = self.hex4()?;
                                if (0xDC00..0xE000).contains(&lo) {
                                    0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
                                } else {
                                    return Err(self.err("unpaired surrogate"));
                                }
                            } else {
                                hi
                            };
                            char::from_u32(cp).unwrap_or('\u{fffd}')
                        }
                        _ => return Err(self.err("unknown escape")),
                    };
                    let mut b = [0u8; 4];
                    out.extend_from_slice(ch.encode_utf8(&mut b).as_bytes());
                }
                c if c < 0x20 => return Err(self.err("control character in a string")),
                c => out.push(c),
            }
        }
        String::from_utf8(out).map_err(|_| self.err("not UTF-8"))
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }
    fn visit_none<E: de::Error>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Json, D::Error> {
        Json::deserialize(d)
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Json, E> {
        Ok(Json::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Json, E> {
        Ok(Json::Int(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Json, E> {
        Ok(match i64::try_from(v) {
            Ok(i) => Json::Int(i),
            Err(_) => Json::UInt(v),
        })
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Json, E> {
        Ok(Json::Float(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Json, E> {
        Ok(Json::Str(v.to_string()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Json, E> {
        Ok(Json::Str(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut v = Vec::new();
        while let Some(x) = seq.next_element::<Json>()? {
            v.push(x);
        }
        Ok(Json::Array(v))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut entries = ObjectBuilder::new();
        while let Some((k, v)) = map.next_entry::<String, Json>()? {
            entries.insert(k, v);
        }
        Ok(entries.finish())
    }
}

/// [`Json::parse_limited`]'s deserializer: a value at `depth`, within `limits`.
#[derive(Clone, Copy)]
struct Limited<'l> {
    limits: &'l JsonLimits,
    depth: usize,
}

impl<'l> Limited<'l> {
    fn string<E: de::Error>(&self, s: &str) -> Result<(), E> {
        if s.len() > self.limits.max_string_bytes {
            return Err(E::custom(format_args!("a string is longer than {} bytes", self.limits.max_string_bytes)));
        }
        Ok(())
    }
    fn nested<E: de::Error>(&self) -> Result<Limited<'l>, E> {
        if self.depth >= self.limits.max_depth {
            return Err(E::custom(format_args!("objects and arrays are nested deeper than {}", self.limits.max_depth)));
        }
        Ok(Limited { limits: self.limits, depth: self.depth + 1 })
    }
}

impl<'de> de::DeserializeSeed<'de> for Limited<'_> {
    type Value = Json;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Json, D::Error> {
        d.deserialize_any(self)
    }
}

/// A key of a limited object.
struct LimitedKey<'l>(&'l JsonLimits);

impl<'de> de::DeserializeSeed<'de> for LimitedKey<'_> {
    type Value = String;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<String, D::Error> {
        let k = String::deserialize(d)?;
        if k.len() > self.0.max_string_bytes {
            return Err(de::Error::custom(format_args!("a key is longer than {} bytes", self.0.max_string_bytes)));
        }
        Ok(k)
    }
}

impl<'de> Visitor<'de> for Limited<'_> {
    type Value = Json;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }
    fn visit_none<E: de::Error>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Json, D::Error> {
        d.deserialize_any(self)
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Json, E> {
        Ok(Json::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Json, E> {
        JsonVisitor.visit_i64(v)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Json, E> {
        JsonVisitor.visit_u64(v)
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Json, E> {
        Ok(Json::Float(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Json, E> {
        self.string(v)?;
        Ok(Json::Str(v.to_string()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Json, E> {
        self.string(&v)?;
        Ok(Json::Str(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let inner = self.nested()?;
        let mut v = Vec::new();
        while let Some(x) = seq.next_element_seed(inner)? {
            if v.len() == self.limits.max_items {
                return Err(de::Error::custom(format_args!("an array holds more than {} items", self.limits.max_items)));
            }
            v.push(x);
        }
        Ok(Json::Array(v))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let inner = self.nested()?;
        let mut entries = ObjectBuilder::new();
        while let Some(k) = map.next_key_seed(LimitedKey(self.limits))? {
            let v = map.next_value_seed(inner)?;
            entries.insert(k, v);
            if entries.len() > self.limits.max_keys {
                return Err(de::Error::custom(format_args!("an object holds more than {} keys", self.limits.max_keys)));
            }
        }
        Ok(entries.finish())
    }
}

impl Serialize for Json {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Json::Null => s.serialize_unit(),
            Json::Bool(b) => s.serialize_bool(*b),
            Json::Int(i) => s.serialize_i64(*i),
            Json::UInt(u) => s.serialize_u64(*u),
            Json::Float(f) => s.serialize_f64(*f),
            Json::Number(n) => s.serialize_f64(n.parse::<f64>().unwrap_or(0.0)),
            Json::Str(v) => s.serialize_str(v),
            Json::Array(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for x in items {
                    seq.serialize_element(x)?;
                }
                seq.end()
            }
            Json::Object(entries) => {
                let mut m = s.serialize_map(Some(entries.len()))?;
                for (k, v) in entries {
                    m.serialize_entry(k, v)?;
                }
                m.end()
            }
        }
    }
}

impl From<&str> for Json {
    fn from(s: &str) -> Self {
        Json::Str(s.to_string())
    }
}

impl From<String> for Json {
    fn from(s: String) -> Self {
        Json::Str(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python_repr() {
        for (x, want) in [
            (1.5, "1.5"),
            (1.0, "1.0"),
            (1e20, "1e+20"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (1e-5, "1e-05"),
            (-2.5e-7, "-2.5e-07"),
            (123456.789, "123456.789"),
            (0.1, "0.1"),
            (1.5e300, "1.5e+300"),
            (-0.0, "-0.0"),
        ] {
            assert_eq!(py_float_repr(x), want, "{x}");
        }
    }

    #[test]
    fn keeps_key_order_and_dumps_like_python() {
        let v =
            Json::parse(r#"{"s": "text", "n": 42, "f": 1.5, "b": true, "nul": null, "obj": {"k": "v"}, "arr": [1, "two", null], "u": "é\u001f\"\\"}"#).unwrap();
        assert_eq!(v.dumps_py(), r#"{"s": "text", "n": 42, "f": 1.5, "b": true, "nul": null, "obj": {"k": "v"}, "arr": [1, "two", null], "u": "é\u001f\"\\"}"#);
        assert_eq!(Json::parse(r#"{"b": [1, {"d": 1, "c": 2}], "a": 1e20}"#).unwrap().deep_sorted().dumps_compact(), r#"{"a":1e+20,"b":[1,{"c":2,"d":1}]}"#);
        assert_eq!(Json::parse(r#"{"a": 1, "b": 2, "a": 3}"#).unwrap().dumps_compact(), r#"{"a":3,"b":2}"#);
    }

    #[test]
    fn keeping_numbers_gives_the_literal_back() {
        let text = r#"{"a": 1.50, "b": 1e3, "c": 12345678901234567890123, "d": -0, "e": 1.5, "f": 7, "g": 1e+20, "h": [0.10, "x\u00e9\ud83d\ude00"], "a2": 18446744073709551615}"#;
        let v = Json::parse_keeping_numbers(text).unwrap();
        assert_eq!(
            v.dumps_py(),
            r#"{"a": 1.50, "b": 1e3, "c": 12345678901234567890123, "d": -0, "e": 1.5, "f": 7, "g": 1e+20, "h": [0.10, "xé😀"], "a2": 18446744073709551615}"#
        );
        // Canonical values stay the usual variants (Python-equal output either way).
        assert_eq!(v.get("e"), Some(&Json::Float(1.5)));
        assert_eq!(v.get("f"), Some(&Json::Int(7)));
        assert_eq!(v.get("g"), Some(&Json::Float(1e20)));
        assert_eq!(v.get("a2"), Some(&Json::UInt(u64::MAX)));
        assert_eq!(v.get("b").map(Json::xtml_type), Some("number"));
        // It agrees with serde on everything else.
        for t in [r#"{"k": [true, false, null, {"n": {}}], "s": "a\"b\\c\n"}"#, "[]", "\"x\"", "-12", "3.25"] {
            assert_eq!(Json::parse_keeping_numbers(t).unwrap(), Json::parse(t).unwrap(), "{t}");
        }
        for bad in ["{", "[1,]", "01", "1.", "\"\\u12\"", "{\"a\" 1}", "1 2", "tru"] {
            assert!(Json::parse_keeping_numbers(bad).is_err(), "{bad}");
        }
    }

    /// `{"model": "m", "ignored": {"k0": 0, "k1": 0, ...}}` with `n` keys in the ignored field
    /// (1.3 MB at 100,000 keys: the body that took 31 CPU-s with a linear duplicate search).
    fn many_keys(n: usize) -> String {
        let mut s = String::from(r#"{"model": "m", "ignored": {"#);
        for i in 0..n {
            if i > 0 {
                s.push_str(", ");
            }
            let _ = write!(s, "\"k{i}\": 0");
        }
        s.push_str("}}");
        s
    }

    fn probes() -> u64 {
        KEY_PROBES.with(|c| c.get())
    }

    #[test]
    fn objects_parse_in_linear_time() {
        let body = many_keys(100_000);
        assert!(body.len() > 1_200_000, "{}", body.len());
        let unlimited = JsonLimits { max_keys: usize::MAX, ..JsonLimits::request(usize::MAX) };
        for parse in [
            &(|t: &str| Json::parse(t).map(|_| ()).map_err(|e| e.to_string())) as &dyn Fn(&str) -> Result<(), String>,
            &|t: &str| Json::parse_limited(t, &unlimited).map(|_| ()).map_err(|e| e.to_string()),
            &|t: &str| Json::parse_keeping_numbers(t).map(|_| ()).map_err(|e| e.to_string()),
        ] {
            let before = probes();
            parse(&body).unwrap();
            let made = probes() - before;
            // a linear search per key makes n²/2 = 5e9 comparisons; the index makes about one
            // look-up a key (plus the first keys' ordered compares)
            assert!(made < 2 * 100_000, "{made} key comparisons for 100,000 keys");
        }
        // repeated keys keep the first position and the last value, with and without the index
        let mut dup = String::from("{");
        for i in 0..40 {
            let _ = write!(dup, "\"k{}\": {i}, ", i % 20);
        }
        dup.push_str("\"end\": 1}");
        let v = Json::parse_limited(&dup, &unlimited).unwrap();
        let o = v.as_object().unwrap();
        assert_eq!(o.len(), 21);
        assert_eq!(o[3], ("k3".to_string(), Json::Int(23)));
        assert_eq!(v, Json::parse(&dup).unwrap());
        assert_eq!(v, Json::parse_keeping_numbers(&dup).unwrap());
    }

    #[test]
    fn request_caps_stop_the_parse_with_the_cap_named() {
        let limits = JsonLimits::request(1 << 20);
        let e = Json::parse_limited(&many_keys(100_000), &limits).unwrap_err().to_string();
        assert!(e.contains("more than 10000 keys"), "{e}");
        assert!(Json::parse_limited(&many_keys(10_000), &limits).is_ok());
        let small = JsonLimits { max_keys: 4, max_items: 3, max_depth: 3, max_string_bytes: 5 };
        for (text, want) in [
            (r#"{"a":1,"b":2,"c":3,"d":4,"e":5}"#, "more than 4 keys"),
            ("[1,2,3,4]", "more than 3 items"),
            ("[[[[1]]]]", "nested deeper than 3"),
            (r#"{"a":"123456"}"#, "longer than 5 bytes"),
            (r#"{"abcdef":1}"#, "longer than 5 bytes"),
        ] {
            let e = Json::parse_limited(text, &small).unwrap_err().to_string();
            assert!(e.contains(want), "{text}: {e}");
        }
        let ok = r#"{"a":[1,[2,"12345"]],"c":1,"a":2}"#;
        assert_eq!(Json::parse_limited(ok, &small).unwrap(), Json::parse(ok).unwrap());
        assert!(Json::parse_limited("{} x", &small).is_err());
    }
}
