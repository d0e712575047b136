//! Frame by frame: collecting headers and bodies, checking them, and landing, refusing or
//! answering what they ask for.

use super::{Part, ServerSession, State};
use crate::error::Error;
use crate::error::{ProtocolViolation, Refusal};
use crate::proto::input::Input;
use crate::proto::{Closed, Event, Landing, Served};
use crate::wire::{self, Header, Kind, HEADER_LEN};
use std::time::Instant;

impl<M: Served> ServerSession<M> {
    /// Handles everything buffered, until more bytes or an event's answer are needed, or
    /// until the answers queued for the peer reach one frame's worth: a peer that asks faster
    /// than it reads must not make this side stage and hold its memory without bound.
    pub(super) fn process(&mut self, now: Instant) {
        while self.closed.is_none() && self.event.is_none() && !self.answers_backed_up() {
            let progressed = match &mut self.state {
                State::Waiting { .. } => false,
                State::Collect { part, need } => {
                    let (part, need) = (*part, *need);
                    let bytes = self.input.take(need - self.scratch.len());
                    if matches!(part, Part::Header) && self.scratch.is_empty() && !bytes.is_empty()
                    {
                        self.frame_started = Some(now);
                    }
                    self.scratch.extend_from_slice(bytes);
                    if self.scratch.len() < need {
                        false
                    } else {
                        if let Err(violation) = self.collected(now, part) {
                            self.close(Closed::Protocol(violation));
                        }
                        true
                    }
                }
                State::Land {
                    spans,
                    index,
                    filled,
                    ..
                } => match land(&mut self.input, spans, index, filled) {
                    Ok(progressed) => progressed,
                    Err(error) => {
                        self.close(Closed::Staging(error.to_string()));
                        false
                    }
                },
                State::Discard { left, .. } => {
                    let dropped = self
                        .input
                        .take(usize::try_from(*left).unwrap_or(usize::MAX));
                    *left -= dropped.len() as u64;
                    !dropped.is_empty() || *left == 0
                }
            };
            self.finish_data(now);
            if !progressed {
                break;
            }
        }
        if self.ended && self.closed.is_none() && self.event.is_none() {
            let between_frames = matches!(
                self.state,
                State::Collect {
                    part: Part::Header,
                    ..
                }
            ) && self.scratch.is_empty();
            match self.state {
                State::Waiting { .. } => {}
                _ if between_frames => self.close(Closed::Finished),
                _ => self.close(Closed::EndedMidFrame),
            }
        }
    }

    /// Moves on once a write's data has all arrived or been thrown away.
    fn finish_data(&mut self, now: Instant) {
        match &mut self.state {
            State::Land {
                id, spans, index, ..
            } if *index == spans.len() => {
                let (id, spans) = (*id, std::mem::take(spans));
                self.state = State::Waiting { id };
                self.event = Some(Event::Store(spans));
            }
            State::Discard {
                id,
                left: 0,
                reason,
            } => {
                let (id, reason) = (
                    *id,
                    std::mem::replace(reason, Refusal::Other(String::new())),
                );
                self.ack(now, id, Err(reason));
                self.finish_frame(now);
            }
            _ => {}
        }
    }

    /// Acts on a completely collected part.
    fn collected(&mut self, now: Instant, part: Part) -> Result<(), ProtocolViolation> {
        match part {
            Part::Header => self.start_frame(now),
            Part::Hello => {
                let hello = wire::decode_hello(&self.scratch)?;
                self.peer = Some(hello.name);
                self.finish_frame(now);
                Ok(())
            }
            Part::Body(header) => self.body(now, header),
            Part::WriteAddress(header) => {
                let mut raw = [0u8; 8];
                raw.copy_from_slice(&self.scratch);
                let addr = u64::from_le_bytes(raw);
                let len = u64::from(header.len - 8);
                if len == 0 {
                    return Err(ProtocolViolation::Malformed("zero-length write"));
                }
                let entry = wire::WriteManyEntry {
                    addr,
                    len: header.len - 8,
                };
                self.land_or_refuse(header.id, &[entry], len);
                Ok(())
            }
            Part::WriteManyCount(header) => {
                let mut count = [0u8; 4];
                count.copy_from_slice(&self.scratch);
                let table_len = wire::decode_write_many_count(
                    count,
                    header.len,
                    self.config.limits.max_entries,
                )?;
                self.collect(Part::WriteManyTable(header), table_len);
                Ok(())
            }
            Part::WriteManyTable(header) => {
                let data_len = u64::from(header.len) - 4 - self.scratch.len() as u64;
                let entries = wire::decode_write_many_table(&self.scratch, data_len)?;
                self.land_or_refuse(header.id, &entries, data_len);
                Ok(())
            }
        }
    }

    /// A whole header arrived: checks it and starts on its body.
    fn start_frame(&mut self, now: Instant) -> Result<(), ProtocolViolation> {
        let mut bytes = [0u8; HEADER_LEN];
        bytes.copy_from_slice(&self.scratch);
        let header = Header::decode(&bytes, &self.config.limits)?;
        match (header.kind, self.peer.is_some()) {
            (Kind::Hello, false) => {
                self.collect(Part::Hello, header.len as usize);
                Ok(())
            }
            (Kind::Hello, true) => Err(unexpected(header.kind, "twice on one connection")),
            (_, false) => Err(unexpected(header.kind, "before hello")),
            (Kind::DescriptorRequest, true) => {
                if header.len != 0 {
                    return Err(ProtocolViolation::TrailingBytes(header.len as usize));
                }
                let json = self.served.descriptor();
                let answer = Header::for_body(Kind::DescriptorResponse, header.id, &json);
                self.queue(now, |output| output.frame(answer, &json));
                self.finish_frame(now);
                Ok(())
            }
            (Kind::Write, true) => {
                if header.len < 8 {
                    return Err(ProtocolViolation::TooShort {
                        what: "write address",
                        needed: 8 - header.len as usize,
                    });
                }
                self.collect(Part::WriteAddress(header), 8);
                Ok(())
            }
            (Kind::WriteMany, true) => {
                if header.len < 4 {
                    return Err(ProtocolViolation::TooShort {
                        what: "write-many count",
                        needed: 4 - header.len as usize,
                    });
                }
                self.collect(Part::WriteManyCount(header), 4);
                Ok(())
            }
            (Kind::ReadRequest | Kind::Notify, true) => {
                self.collect(Part::Body(header), header.len as usize);
                Ok(())
            }
            (Kind::DescriptorResponse | Kind::ReadData | Kind::Ack, true) => {
                Err(unexpected(header.kind, "at a listener"))
            }
        }
    }

    /// The whole body of a read request or a notification arrived.
    fn body(&mut self, now: Instant, header: Header) -> Result<(), ProtocolViolation> {
        if header.kind == Kind::Notify {
            let payload = std::mem::take(&mut self.scratch);
            self.state = State::Waiting { id: header.id };
            self.event = Some(Event::Notify(payload));
            return Ok(());
        }
        let (addr, len) = wire::decode_read_request(&self.scratch)?;
        if len > self.config.limits.max_data {
            return Err(ProtocolViolation::Oversized {
                kind: "read-request",
                len: u64::from(len),
                limit: u64::from(self.config.limits.max_data),
            });
        }
        match self.served.span(addr, u64::from(len)) {
            Some(span) => {
                self.state = State::Waiting { id: header.id };
                self.event = Some(Event::Load(span));
            }
            None => {
                self.ack(now, header.id, Err(refusal(addr, u64::from(len))));
                self.finish_frame(now);
            }
        }
        Ok(())
    }

    /// Every entry is checked before the first byte lands: one outside the registrations has
    /// the whole frame's data thrown away and the frame refused, so nothing of it is written.
    /// That is not "whole or not at all": once landing has started, a frame that stalls or
    /// whose connection breaks part-way leaves the bytes that already arrived in their
    /// destinations, and only the missing acknowledgement tells the sender it failed.
    fn land_or_refuse(&mut self, id: u64, entries: &[wire::WriteManyEntry], data_len: u64) {
        let mut spans = Vec::with_capacity(entries.len());
        for entry in entries {
            match self.served.span(entry.addr, u64::from(entry.len)) {
                Some(span) => spans.push(span),
                None => {
                    drop(spans);
                    self.state = State::Discard {
                        id,
                        left: data_len,
                        reason: refusal(entry.addr, u64::from(entry.len)),
                    };
                    return;
                }
            }
        }
        self.state = State::Land {
            id,
            spans,
            index: 0,
            filled: 0,
        };
    }
}

/// Moves buffered bytes into the current span; `true` when any moved or a span completed.
fn land<S: Landing>(
    input: &mut Input,
    spans: &mut [S],
    index: &mut usize,
    filled: &mut usize,
) -> Result<bool, Error> {
    let Some(span) = spans.get_mut(*index) else {
        return Ok(false);
    };
    let destination = span.receive_into()?;
    let bytes = input.take(destination.len() - *filled);
    destination[*filled..*filled + bytes.len()].copy_from_slice(bytes);
    *filled += bytes.len();
    if *filled < destination.len() {
        return Ok(!bytes.is_empty());
    }
    *index += 1;
    *filled = 0;
    Ok(true)
}

/// The refusal of a range outside the registrations; the sender finds its batch entry.
fn refusal(addr: u64, len: u64) -> Refusal {
    Refusal::NotRegistered {
        entry: None,
        addr,
        len,
    }
}

fn unexpected(kind: Kind, context: &'static str) -> ProtocolViolation {
    ProtocolViolation::Unexpected {
        kind: kind.name(),
        context,
    }
}
