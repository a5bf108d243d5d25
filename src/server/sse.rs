//! Server-sent events for streaming responses: one `data:` line per chunk, an error chunk if
//! generation fails midway, and `data: [DONE]` at the end.

use super::generation::{Choices, Piece};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};
use std::convert::Infallible;

/// What the renderer is given: a choice's piece, then once every choice has finished, the end.
pub enum Item {
    Piece(usize, Piece),
    End,
}

/// Streams the `n` choices through `render`, which turns each item into zero or more chunks.
pub fn sse_response<F>(choices: Choices, n: usize, render: F) -> Response
where
    F: FnMut(Item) -> Vec<serde_json::Value> + Send + 'static,
{
    Sse::new(events(choices, n, render)).keep_alive(KeepAlive::default()).into_response()
}

struct State<F> {
    /// None once finished or failed (dropping it cancels what still runs).
    choices: Option<Choices>,
    render: F,
    ready: std::collections::VecDeque<Event>,
    running: usize,
    done: bool,
}

fn events<F>(choices: Choices, n: usize, render: F) -> impl Stream<Item = Result<Event, Infallible>>
where
    F: FnMut(Item) -> Vec<serde_json::Value> + Send + 'static,
{
    let state = State { choices: Some(choices), render, ready: Default::default(), running: n, done: false };
    stream::unfold(state, |mut s| async move {
        loop {
            if let Some(e) = s.ready.pop_front() {
                return Some((Ok(e), s));
            }
            if s.done {
                return None;
            }
            let next = match s.choices.as_mut() {
                Some(c) => c.recv().await,
                None => None,
            };
            let chunks = match next {
                Some((index, Ok(piece))) => {
                    let finished = matches!(piece, Piece::Done { .. });
                    let mut chunks = (s.render)(Item::Piece(index, piece));
                    if finished {
                        s.running -= 1;
                        if s.running == 0 {
                            chunks.extend((s.render)(Item::End));
                            s.choices = None;
                        }
                    }
                    chunks
                }
                Some((_, Err(e))) => {
                    s.choices = None;
                    vec![e.body()]
                }
                None => {
                    s.choices = None;
                    vec![]
                }
            };
            s.ready.extend(chunks.into_iter().map(|v| Event::default().data(v.to_string())));
            if s.choices.is_none() {
                s.done = true;
                s.ready.push_back(Event::default().data("[DONE]"));
            }
        }
    })
}
