//! Frame by frame: collecting headers and bodies, checking them, and landing, refusing or
//! answering what they ask for.

use super::{AfterData, Part, ServerSession, State};
use crate::error::Error;
use crate::error::{ProtocolViolation, Refusal};
use crate::proto::input::Input;
use crate::proto::{Closed, Event, Landing, Served};
use crate::wire::seal::{Opener, TAG_LEN};
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
                } => match land(&mut self.input, &mut self.opener, spans, index, filled) {
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
                    if let Some(opener) = &mut self.opener {
                        opener.update(dropped);
                    }
                    *left -= dropped.len() as u64;
                    !dropped.is_empty() || *left == 0
                }
                State::Seal { .. } => {
                    let bytes = self.input.take(TAG_LEN - self.scratch.len());
                    let took = !bytes.is_empty();
                    self.scratch.extend_from_slice(bytes);
                    let whole = self.scratch.len() == TAG_LEN;
                    if whole {
                        self.data_sealed(now);
                    }
                    took || whole
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

    /// Moves on once a write's data has all arrived or been thrown away: on a sealed
    /// connection, to the tag that ends the frame.
    fn finish_data(&mut self, now: Instant) {
        let (id, then) = match &mut self.state {
            State::Land {
                id, spans, index, ..
            } if *index == spans.len() => (*id, AfterData::Store(std::mem::take(spans))),
            State::Discard {
                id,
                left: 0,
                reason,
            } => (
                *id,
                AfterData::Refuse(std::mem::replace(reason, Refusal::Other(String::new()))),
            ),
            _ => return,
        };
        match self.frame_kind {
            Some(kind) if self.opener.is_some() => {
                self.scratch.clear();
                self.state = State::Seal { id, kind, then };
            }
            _ => self.after_data(now, id, then),
        }
    }

    /// The tag after a write's data is in: checks it, then stores or refuses.
    fn data_sealed(&mut self, now: Instant) {
        let State::Seal { id, kind, then } =
            std::mem::replace(&mut self.state, State::Waiting { id: 0 })
        else {
            return;
        };
        let checked = match &mut self.opener {
            Some(opener) => opener.finish(kind, &self.scratch),
            None => Ok(()),
        };
        match checked {
            Ok(()) => self.after_data(now, id, then),
            Err(violation) => {
                // Told first, so the sender's transfer fails with the reason; its bytes may
                // have landed, and a destination is undefined until its frame is acked.
                self.ack(now, id, Err(Refusal::Other(violation.to_string())));
                self.close(Closed::Protocol(violation));
            }
        }
    }

    fn after_data(&mut self, now: Instant, id: u64, then: AfterData<M::Span>) {
        match then {
            AfterData::Store(spans) => {
                self.state = State::Waiting { id };
                self.event = Some(Event::Store(spans));
            }
            AfterData::Refuse(reason) => {
                self.ack(now, id, Err(reason));
                self.finish_frame(now);
            }
        }
    }

    /// Takes a collected part's bytes into the frame's running tag; for a part that ends with
    /// a tag on a sealed connection, checks it (`last`: the frame's last tag, else the one
    /// before its data) and leaves only the part's own bytes in the scratch buffer.
    fn open_part(&mut self, kind: Kind, tagged: Option<bool>) -> Result<(), ProtocolViolation> {
        let Some(opener) = &mut self.opener else {
            return Ok(());
        };
        let Some(last) = tagged else {
            opener.update(&self.scratch);
            return Ok(());
        };
        let own = self.scratch.len() - TAG_LEN;
        opener.update(&self.scratch[..own]);
        match last {
            true => opener.finish(kind, &self.scratch[own..])?,
            false => opener.check_prefix(kind, &self.scratch[own..])?,
        }
        self.scratch.truncate(own);
        Ok(())
    }

    /// Acts on a completely collected part.
    fn collected(&mut self, now: Instant, part: Part) -> Result<(), ProtocolViolation> {
        match part {
            Part::Header => self.start_frame(now),
            Part::Hello => {
                self.open_part(Kind::Hello, Some(true))?;
                let hello = wire::decode_hello(&self.scratch)?;
                self.peer = Some(hello.name);
                self.finish_frame(now);
                Ok(())
            }
            Part::Body(header) => {
                self.open_part(header.kind, Some(true))?;
                self.body(now, header)
            }
            Part::WriteAddress(header) => {
                self.open_part(header.kind, Some(false))?;
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
                self.open_part(header.kind, None)?;
                let mut count = [0u8; 4];
                count.copy_from_slice(&self.scratch);
                let table_len = wire::decode_write_many_count(
                    count,
                    header.len,
                    self.config.limits.max_entries,
                )?;
                self.collect(Part::WriteManyTable(header), self.tagged(table_len));
                Ok(())
            }
            Part::WriteManyTable(header) => {
                self.open_part(header.kind, Some(false))?;
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
        if let Some(opener) = &mut self.opener {
            opener.begin(&bytes);
        }
        self.frame_kind = Some(header.kind);
        match (header.kind, self.peer.is_some()) {
            (Kind::Hello, false) => {
                self.collect(Part::Hello, self.tagged(header.len as usize));
                Ok(())
            }
            (Kind::Hello, true) => Err(unexpected(header.kind, "twice on one connection")),
            (_, false) => Err(unexpected(header.kind, "before hello")),
            (Kind::DescriptorRequest, true) => {
                if header.len != 0 {
                    return Err(ProtocolViolation::TrailingBytes(header.len as usize));
                }
                if self.opener.is_some() {
                    self.collect(Part::Body(header), TAG_LEN);
                } else {
                    self.answer_descriptor(now, header);
                }
                Ok(())
            }
            (Kind::Write, true) => {
                if header.len < 8 {
                    return Err(ProtocolViolation::TooShort {
                        what: "write address",
                        needed: 8 - header.len as usize,
                    });
                }
                self.collect(Part::WriteAddress(header), self.tagged(8));
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
                self.collect(Part::Body(header), self.tagged(header.len as usize));
                Ok(())
            }
            (Kind::DescriptorResponse | Kind::ReadData | Kind::Ack, true) => {
                Err(unexpected(header.kind, "at a listener"))
            }
        }
    }

    fn answer_descriptor(&mut self, now: Instant, header: Header) {
        let json = self.served.descriptor();
        let answer = Header::for_body(Kind::DescriptorResponse, header.id, &json);
        self.answer(now, answer, &json);
        self.finish_frame(now);
    }

    /// The whole body of a read request or a notification arrived (or, on a sealed
    /// connection, a descriptor request's tag).
    fn body(&mut self, now: Instant, header: Header) -> Result<(), ProtocolViolation> {
        if header.kind == Kind::DescriptorRequest {
            self.answer_descriptor(now, header);
            return Ok(());
        }
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
    opener: &mut Option<Opener>,
    spans: &mut [S],
    index: &mut usize,
    filled: &mut usize,
) -> Result<bool, Error> {
    let Some(span) = spans.get_mut(*index) else {
        return Ok(false);
    };
    let mut destination = span.destination()?.after(*filled);
    let bytes = input.take(destination.remaining());
    destination.fill(bytes);
    // Hashed from the buffered copy, ferry's own memory.
    if let Some(opener) = opener {
        opener.update(bytes);
    }
    *filled = destination.filled();
    if destination.remaining() > 0 {
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
